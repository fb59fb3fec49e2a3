"""epdserve: Encode / Prefill / Decode disaggregated serving for vision-language models.

Public API: `LLM` and `SamplingParams` (offline, vLLM-shaped; `StructuredOutput`: a structured
output's constraint), and `Client` / `AsyncClient` (epdserve/client/) for a running deployment's
gRPC service. Everything else is the `epdserve` command (epdserve/entrypoints/cli.py): `launch`,
`scheduler`, `instance`, `demo-model`, `bench`, `profile`.

Package map, bottom to top (the layers of .importlinter's contract; docs/architecture.md draws them):
- proto_gen/       protoc output (epdserve.v1 messages and services), generated, never edited
- commands.py      command registration for every `epdserve` sub-command, importable from any layer
- settings.py      settings dataclasses whose fields make the command-line flags (engine, instance, scheduler, launch)
- roles.py         the role sets as one table (`RoleSet`: stages, workers, RPCs, inline encoding, KV held)
- kv_layout.py     `KvLayout`: an instance's KV registration record (degree, head map, dtype, quantization)
- slo.py           `SLO`: the TTFT / TPOT objectives, one declaration for bench, planner, controller, engines
- request_errors.py  errors a request fails with for what it asked (INVALID_ARGUMENT / HTTP 400)
- net.py           `free_port`: local networking helpers, no gRPC or torch
- platform/        cpu | cuda | npu: device handle, dist backend, streams, core limits
- ops/             paged-KV attention operators, one implementation per platform
- model/           a Hugging Face Qwen-VL checkpoint as the engine uses it, and its inputs
- seams/           the two connector interfaces (KV, features) and media keys, below engine and transfer
- limits.py        input limits of one request, checked before any work is spent on it
- security/        API key, cluster token, TLS: who may call what
- rpc/             the wire: the generated modules re-exported, and gRPC server helpers
- engine/          one engine: request states, scheduler + block manager, model runner, sampler
- transfer/        what moves between stages: the MM Store (E->P) and the layerwise KV hop (P->D)
- instance/        one process hosting stage workers (E, P, D, co-located, coupled)
- scheduler/       the global scheduler: public gRPC front, registry, routing, request fan-out
- perf/            the vocabulary bench and planner share: workloads, SLO scoring, profiles
- metrics/         the scheduler's Prometheus metrics
- deploy/          deploying: local/ (`epdserve launch`: one mode's processes on this machine, started
                   and stopped as a whole) and kube/ (`epdserve k8s render`: a mode's Kubernetes manifests)
- planner/         `epdserve plan`: predict every mode's and split's SLO goodput, pick one
- client/          `Client` / `AsyncClient`: the gRPC client library of a running deployment
- entrypoints/     the `epdserve` command, the HTTP front and the offline `LLM`
- checks/          beside entrypoints: does this machine and install work (`epdserve doctor`'s checks, the device
                   check, the NPU checks)
- bench/           `epdserve bench ...` and `epdserve profile`: configurations measured side by side
"""
import os

# torch imports every installed device backend through its "torch.backends" entry points; torch_npu
# is one, and on a host where it cannot load (no CANN, no driver) `import torch` itself then fails.
# epdserve imports torch_npu itself, lazily, only in platform/npu.py and ops/npu_ops.py, where a
# failure becomes a clear reason (`epdserve doctor`, get_platform). Set the variable to 1 to restore
# torch's autoload.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from epdserve.engine.sampling_params import SamplingParams  # noqa: E402
from epdserve.engine.structured_output import StructuredOutput  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "Client", "AsyncClient"]


def __getattr__(name):
    # Lazy: importing epdserve must stay cheap (no model code, no gRPC) until asked for.
    if name == "LLM":
        from epdserve.entrypoints.llm import LLM

        return LLM
    if name in ("Client", "AsyncClient"):
        import epdserve.client

        return getattr(epdserve.client, name)
    raise AttributeError(name)
