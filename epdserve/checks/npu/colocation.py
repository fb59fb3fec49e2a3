"""`epdserve bench colocation --device npu`: the hardware check that co-located stages keep to
their core limits (docs/npu-colocation.md, "Verifying on hardware").

Each stage's work (E: encoding images; P: a prefill step; D: decode steps) runs on its own
thread and stage stream, opened as a co-located worker opens it (`open_stage_stream`: a limit
only where no operator of the stage is known to ignore one), under torch_npu's profiler (`NpuPlatform.profile_kernels`)
at Level0 with NPU activity — the lightest level that writes kernel_details.csv
(torch_npu/profiler/analysis/_profiling_parser.py `run_parser`: every level but Level_none; the
op-plugin torch_npu-set_stream_limit.md example uses Level2, which adds CANN's columns). The
limit read back (`torch.npu.get_stream_limit(stream)`, or `get_device_limit` where the stage
stream stayed unrestricted) is what each kernel's Block Dim is held to
(checks/npu/kernel_details.py). A kernel over its limit is a failed check, named; the table and
the JSON say so per stage. Only runs with an NPU; elsewhere it stops with the reason.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import tempfile
import threading

from epdserve.checks.npu.kernel_details import check, failures, find_kernel_details, read_kernels
from epdserve.roles import ENCODE, PREFILL, STAGES

IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"


def require_npu() -> None:
    """SystemExit with the reason where no NPU can run the check (no torch_npu, no device)."""
    from epdserve.platform.npu import NpuPlatform

    reason = NpuPlatform().unavailable_reason()
    if reason:
        raise SystemExit(f"bench colocation --device npu needs an Ascend NPU with torch_npu: {reason}")


def run(args) -> int:
    require_npu()
    rig = _NpuRig(args)
    rows = [rig.verify(stage) for stage in STAGES]
    report = {"benchmark": "colocation", "device": "npu", "model": str(rig.model_dir),
              "share": args.npu_share, "kernel_check": rows, "passed": all(r["passed"] for r in rows)}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(rows))
    print(f"wrote {args.out}")
    return 0 if report["passed"] else 1


class _NpuRig:
    def __init__(self, args):
        from epdserve.engine.config import EngineConfig
        from epdserve.engine.llm_engine import LLMEngine
        from epdserve.engine.loaded_model import load_model
        from epdserve.engine.sampling_params import SamplingParams
        from epdserve.model.demo_cache import cached_demo_model
        from epdserve.seams.feature_provider import LocalFeatureProvider

        self.args = args
        self.model_dir = pathlib.Path(args.model) if args.model else cached_demo_model(args.arch, args.size)
        c = EngineConfig(model=str(self.model_dir), device="npu")
        self._limit_whole_device()  # before the load's first operator: stream limits need it first
        self.model = load_model(c.model, c.device, c.dtype, c.max_model_len)
        self.lm = LLMEngine(EngineConfig(model=str(self.model_dir), device="npu", max_num_seqs=args.batch_size),
                            model=self.model)
        self.encoder = LLMEngine(EngineConfig(model=str(self.model_dir), device="npu", roles="E"), model=self.model,
                                 features=LocalFeatureProvider(max_bytes=64 << 20))
        self.params = SamplingParams(max_tokens=64, ignore_eos=True)
        self._ids = iter(range(1 << 62))

    def _limit_whole_device(self) -> None:
        """set_device_limit to the whole device, once, before any operator: set_stream_limit must
        come after it (op-plugin torch_npu-set_stream_limit.md, 7.2.0 / 7.3.0 / 26.0.0)."""
        from epdserve.platform import get_platform

        platform = get_platform("npu")
        platform.set_thread_device(0)
        total = platform.device_limit()
        platform.limit_device(0, total["cube_core_num"], total["vector_core_num"])

    def verify(self, stage: str) -> dict:
        out: list = []
        t = threading.Thread(target=lambda: out.append(self._on_stage_thread(stage)), name=f"verify-{stage}")
        t.start()
        t.join()
        if not out:
            raise RuntimeError(f"stage {stage}: the verification thread failed (see its error above)")
        return out[0]

    def _on_stage_thread(self, stage: str) -> dict:
        from epdserve.instance.stage_stream import npu_stage_operators, open_stage_stream

        platform = self.model.platform
        platform.set_thread_device(0)
        engine = self.encoder if stage == ENCODE else self.lm
        ops = npu_stage_operators(platform, stage, engine.runner.ops)
        # the measurement itself: limits on, unverified operators included (what it verifies)
        stream = open_stage_stream(platform, self.args.npu_share, f"{stage}-verify", operators=ops, opted_in=True)
        device_limit = platform.device_limit()
        limit = platform.stream_limit(stream) if stream is not None else device_limit
        limited = limit != device_limit
        with tempfile.TemporaryDirectory(prefix=f"epdserve-prof-{stage}-") as d:
            with platform.stream_context(stream) if stream is not None else contextlib.nullcontext():
                self._warm(stage)
                with platform.profile_kernels(d):
                    self._work(stage)
                    platform.synchronize()
            files = find_kernel_details(d)
            if not files:
                raise RuntimeError(f"stage {stage}: the profiler wrote no kernel_details.csv under {d}")
            kernels = [k for f in files for k in read_kernels(f)]
        checks = check(kernels, limit["cube_core_num"], limit["vector_core_num"])
        over = failures(checks)
        return {"stage": stage, "stream_limited": bool(limited), "cube_limit": limit["cube_core_num"],
                "vector_limit": limit["vector_core_num"], "kernels": len(checks),
                "checked": sum(c.limit is not None for c in checks),
                "max_block_dim": max((c.kernel.block_dim or 0 for c in checks), default=0),
                "over_limit": over, "operators_unverified": [o.name for o in ops if o.limit != "honours"],
                "passed": not over}

    def _warm(self, stage: str) -> None:
        self._work(stage)  # first calls compile / cache executors outside the profile

    def _work(self, stage: str) -> None:
        if stage == ENCODE:
            self._encode()
        else:
            self._language(decode_steps=0 if stage == PREFILL else 4, prefill_only=stage == PREFILL)

    def _encode(self) -> None:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(next(self._ids))
        side = self.args.image_size
        img = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        self.encoder.add_request(self.encoder.build_request(f"e{next(self._ids)}", IMAGE_PROMPT, [img]))
        while self.encoder.has_unfinished():
            self.encoder.step()

    def _language(self, decode_steps: int, prefill_only: bool) -> None:
        rids = [f"l{next(self._ids)}" for _ in range(self.args.batch_size)]
        for rid in rids:
            self.lm.add_request(self.lm.build_request(rid, "describe the weather " * 8, None, self.params))
        self.lm.step()  # the prefill step
        for _ in range(decode_steps):
            self.lm.step()
        for rid in rids:
            self.lm.abort(rid)
        while self.lm.has_unfinished():
            self.lm.step()


def table(rows: list[dict]) -> str:
    lines = ["stage | stream limited | cube / vector limit | kernels (checked) | max Block Dim | check",
             "------|----------------|---------------------|-------------------|---------------|------"]
    for r in rows:
        verdict = "pass" if r["passed"] else "FAIL over limit: " + ", ".join(r["over_limit"])
        lines.append(f"{r['stage']:5} | {'yes' if r['stream_limited'] else 'no':14} | "
                     f"{r['cube_limit']:>9} / {r['vector_limit']:<7} | {r['kernels']:>8} ({r['checked']}) "
                     f"{'':5}| {r['max_block_dim']:13} | {verdict}")
    return "\n".join(lines)
