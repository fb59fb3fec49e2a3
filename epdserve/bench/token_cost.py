"""Where a served token's time goes: CPU time per output token, by process and by stage.

Owns the two measurements `benchmarks/served_token_cost.py` combines, both from outside the
processes (nothing in the serving path is instrumented for it):
- `cpu_seconds(pids)`: user + system CPU seconds of each process and all its threads so far
  (psutil); the difference over a phase, divided by the phase's output tokens, is each process's
  CPU cost per served token.
- `classify_stacks(raw)`: py-spy's raw output (`py-spy record --format raw`: one line per distinct
  stack, frames outermost first, `;`-separated, then the sample count; idle threads not sampled)
  counted by stage. A sample inside the vision encoder is `vision`; any other belongs to the stage
  whose rule (`STAGES`, in order) first matches a frame, from the innermost frame outwards, else to
  "other". Stages: `lm-forward` (the language model's operators: epdserve/engine/lm, ops, model,
  torch, transformers), `engine-step` (the engine's own Python around the forward:
  epdserve/engine), `detokenize` (tokenizers, the output processor), `grpc` (grpc's own code: (de)serialising, the completion queue, both ends),
  `rpc-handlers` (epdserve's servicers and client calls: epdserve/rpc, instance, client),
  `scheduler` (routing, dispatch, registry: epdserve/scheduler), `http-front` (the OpenAI front,
  its SSE: epdserve/entrypoints/http, fastapi, starlette, uvicorn, pydantic), `asyncio` (the event
  loop's own machinery), `other`.
The CPU seconds of a process split over its stages in proportion to their samples.
"""
from __future__ import annotations

import re
from collections import Counter

# a stack inside the vision encoder is `vision`, whatever runs innermost
VISION = re.compile(r"epdserve/engine/encode_stage|epdserve/model/vision")
# (stage, pattern on a frame's "function (file:line)" text), tried innermost frame first
STAGES: list[tuple[str, re.Pattern]] = [
    ("detokenize", re.compile(r"\btokenizers\b|detokeniz|epdserve/engine/output")),
    ("grpc", re.compile(r"\bgrpc/|cygrpc|google/protobuf|_upb")),
    ("http-front", re.compile(r"epdserve/entrypoints/http/|\bfastapi/|\bstarlette/|\buvicorn/|\bpydantic|\bh11/|httptools")),
    ("lm-forward", re.compile(r"epdserve/engine/lm/|epdserve/ops/|epdserve/model/|\btorch/|\btransformers/")),
    ("engine-step", re.compile(r"epdserve/engine/")),
    ("scheduler", re.compile(r"epdserve/scheduler/")),
    ("rpc-handlers", re.compile(r"epdserve/rpc/|epdserve/instance/|epdserve/client/|epdserve/transfer/")),
    ("asyncio", re.compile(r"\basyncio/|selectors\.py|uvloop")),
]
STAGE_NAMES = ["vision"] + [s for s, _ in STAGES] + ["other"]
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def stage_of(frames: list[str]) -> str:
    """The stage of one sampled stack (`frames` outermost first)."""
    if any(VISION.search(f) for f in frames):
        return "vision"
    for frame in reversed(frames):
        for stage, rule in STAGES:
            if rule.search(frame):
                return stage
    return "other"


def classify_stacks(raw: str) -> Counter:
    """Samples per stage of a py-spy raw (collapsed) profile."""
    out: Counter = Counter()
    for line in raw.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        out[stage_of(m.group("stack").split(";"))] += int(m.group("count"))
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """{name: user + system CPU seconds so far} of each process (0.0 for one that has gone)."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


def process_roles(launcher_pid: int) -> dict[str, int]:
    """{role: pid} of a launched deployment's processes: `launcher`, `scheduler` (with its HTTP
    front), `mm_store`, and each instance by its roles (`instance:EPD`, `instance:D#2`, ...), from
    their command lines (deploy/local/deployment.py starts them)."""
    import psutil

    out = {"launcher": launcher_pid}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        text = " ".join(cmd)
        if "epdserve.entrypoints.scheduler_cli" in text:
            out["scheduler"] = child.pid
        elif "instance" in cmd and "--roles" in cmd:
            name = f"instance:{cmd[cmd.index('--roles') + 1]}"
            n = sum(1 for k in out if k == name or k.startswith(name + "#"))
            out[name if n == 0 else f"{name}#{n + 1}"] = child.pid
        elif "redis" in text or "valkey" in text:
            out["mm_store"] = child.pid
    return out
