"""epdserve: Encode / Prefill / Decode disaggregated serving for vision-language models.

Public API: `LLM` and `SamplingParams` (offline, vLLM-shaped), and `Client` / `AsyncClient`
for a running deployment's gRPC service. Everything else is the `epdserve` command
(epdserve/entrypoints/cli.py): `launch`, `scheduler`, `instance`, `demo-model`, `bench`, `profile`.
"""
from epdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "Client", "AsyncClient"]


def __getattr__(name):
    # Lazy: importing epdserve must stay cheap (no model code, no gRPC) until asked for.
    if name == "LLM":
        from epdserve.entrypoints.llm import LLM

        return LLM
    if name in ("Client", "AsyncClient"):
        from epdserve.entrypoints import client

        return getattr(client, name)
    raise AttributeError(name)
