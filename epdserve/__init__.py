"""epdserve: Encode / Prefill / Decode disaggregated serving for vision-language models.

Public API: `LLM` and `SamplingParams` (offline, vLLM-shaped), and `Client` / `AsyncClient`
for a running deployment's gRPC service. Everything else is the `epdserve` command
(epdserve/entrypoints/cli.py): `launch`, `scheduler`, `instance`, `demo-model`, `bench`, `profile`.
"""
import os

# torch imports every installed device backend through its "torch.backends" entry points; torch_npu
# is one, and on a host where it cannot load (no CANN, no driver) `import torch` itself then fails.
# epdserve imports torch_npu itself, lazily, only in platform/npu.py and ops/npu_ops.py, where a
# failure becomes a clear reason (`epdserve doctor`, get_platform). Set the variable to 1 to restore
# torch's autoload.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from epdserve.engine.sampling_params import SamplingParams  # noqa: E402

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
