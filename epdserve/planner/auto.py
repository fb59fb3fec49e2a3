"""`epdserve launch --mode auto`, its first step: the deployment to start with.

From a profile of the model on this machine (`--profile JSON`, or one measured now with one repeat
per point and cached in ~/.cache/epdserve/profiles, keyed by the checkpoint and torch version) and
the workload the operator declares (`--expected-workload`, default the mixed preset, at
`--expected-rate`, default the preset's busier rate), the planner ranks every mode and E:P:D split
for the devices (`--devices`, default 2 core groups of this one CPU host) and the best is started.
The scheduler's controller then moves instances between roles as the real traffic asks.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_WORKLOAD = "mixed"
PROFILE_CACHE = Path.home() / ".cache" / "epdserve" / "profiles"


@dataclass(frozen=True)
class StartPlan:
    mode: str
    encode: int
    prefill: int
    decode: int
    predicted_goodput: float
    described: str  # the workload and devices it was planned for

    def line(self) -> str:
        return (f"planned {self.mode} (E:P:D {self.encode}:{self.prefill}:{self.decode}) for {self.described}: "
                f"predicted goodput {self.predicted_goodput:.3f} req/s")


def profile_path(model: str) -> Path:
    import torch

    cfg = Path(model) / "config.json"
    stamp = f"{Path(model).resolve()}|{cfg.stat().st_mtime_ns if cfg.exists() else 0}|{torch.__version__}"
    return PROFILE_CACHE / f"{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"


def ensure_profile(model: str, device: str, given: str | None) -> str:
    """The profile to plan with: `given`, or the cached one of this checkpoint, or one measured now."""
    if given:
        return given
    path = profile_path(model)
    if not path.exists():
        from epdserve.perf.profiler import run_profile

        log.info("auto: profiling %s once (cached in %s)", model, path)
        report = run_profile(model, device=device, resolutions=["160x90", "320x180", "480x270"],
                             prompt_lens=[32, 128, 512], batch_sizes=[1, 4, 16], repeats=1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    return str(path)


def plan_start(model: str, device: str = "cpu", profile: str | None = None, workload: str = DEFAULT_WORKLOAD,
               rate: float | None = None, devices: int = 2, requests: int = 40, slo=None) -> StartPlan:
    """Rank every deployment for the declared workload by goodput under `slo` (default: epdserve/slo.py's,
    launch passes its --slo-ttft-ms / --slo-tpot-ms); the best one (see the module docstring)."""
    from epdserve.instance.modes import MODES
    from epdserve.perf.presets import PRESET_RATES, PRESETS
    from epdserve.planner import rank
    from epdserve.planner.costs import CostModel
    from epdserve.planner.shapes import shapes_from_preset

    if workload not in PRESETS:
        raise ValueError(f"--expected-workload must be one of {', '.join(PRESETS)}, got {workload!r}")
    rate = rate if rate is not None else PRESET_RATES.get(workload, (1.0, 1.0))[-1]
    if not rate > 0 or devices < 1:
        raise ValueError("--expected-rate must be > 0 and --devices >= 1")
    costs, _ = CostModel.load(ensure_profile(model, device, profile))
    colocated = device.startswith("cpu")  # one CPU host: every instance shares its cores
    shapes = shapes_from_preset(workload, rate, model, requests)
    best = rank.rank(costs, shapes, devices, colocated, MODES, slo or rank.DEFAULT_SLO)[0]
    d = best.deployment
    where = f"{devices} core group(s) of this host" if colocated else f"{devices} device(s)"
    return StartPlan(d.mode, d.encode, d.prefill, d.decode, best.goodput,
                     f"{workload} at {rate:g} req/s on {where}")
