"""`epdserve launch --mode auto`, its first step: the deployment to start with.

From a profile of the model on this machine (`--profile JSON`, or one measured now with one repeat
per point and cached in ~/.cache/epdserve/profiles, keyed by the checkpoint and torch version) and
the workload the operator declares (`--expected-workload`, default the mixed preset, at
`--expected-rate`, default the preset's busier rate), the planner ranks every mode and E:P:D split
for the devices (`--devices`, default 2 core groups of this one CPU host) and the best is started.
The scheduler's controller then moves instances between roles as the real traffic asks.

With tensor-parallel degrees (the launch flags, `planner.deployment.StageDegrees`), an instance of
degree N takes N devices and steps at the costs of a profile measured at N (one per degree used;
`--profile A,B` names them, each saying its degree, the rest are measured and cached per degree).
The controller is then left off: it moves an instance between roles at the degree it started with,
so with degrees it could move a prefill rank group into a decode pool of another degree.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from epdserve.planner.deployment import StageDegrees

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
    devices_used: int = 0  # devices (core groups) its instances take, each as many as its degree

    def line(self) -> str:
        return (f"planned {self.mode} (E:P:D {self.encode}:{self.prefill}:{self.decode}, {self.devices_used} "
                f"device(s)) for {self.described}: predicted goodput {self.predicted_goodput:.3f} req/s")


def profile_path(model: str, degree: int = 1, cache: Path | None = None) -> Path:
    import torch

    cfg = Path(model) / "config.json"
    stamp = f"{Path(model).resolve()}|{cfg.stat().st_mtime_ns if cfg.exists() else 0}|{torch.__version__}"
    stamp += f"|tp{degree}" if degree > 1 else ""
    return (cache or PROFILE_CACHE) / f"{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"


def ensure_profile(model: str, device: str, given: str | None, degree: int = 1, cache: Path | None = None) -> str:
    """The profile to plan with at `degree`: `given`, or the cached one of this checkpoint at that
    degree, or one measured now (and cached)."""
    if given:
        return given
    path = profile_path(model, degree, cache)
    if not path.exists():
        from epdserve.perf.profiler import run_profile

        log.info("auto: profiling %s at tensor_parallel_size %d once (cached in %s)", model, degree, path)
        report = run_profile(model, device=device, resolutions=["160x90", "320x180", "480x270"],
                             prompt_lens=[32, 128, 512], batch_sizes=[1, 4, 16], repeats=1,
                             tensor_parallel_size=degree)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    return str(path)


def profiles_for(model: str, device: str, given: str | None, degrees: StageDegrees,
                 cache: Path | None = None) -> list[str]:
    """One profile per degree the plan can use: the given ones (comma-separated, each at the degree
    it records), the rest cached or measured."""
    from epdserve.planner.costs import degree_of
    from epdserve.planner.reports import read_report

    have: dict[int, str] = {}
    for path in [p.strip() for p in (given or "").split(",") if p.strip()]:
        have.setdefault(degree_of(read_report(path, "profile", ValueError, "profile", "`epdserve profile` report")),
                        path)
    return [have.get(d) or ensure_profile(model, device, None, d, cache) for d in sorted(degrees.used() | set(have))]


def plan_start(model: str, device: str = "cpu", profile: str | None = None, workload: str = DEFAULT_WORKLOAD,
               rate: float | None = None, devices: int = 2, requests: int = 40, slo=None,
               degrees: StageDegrees = StageDegrees(), cache: Path | None = None) -> StartPlan:
    """Rank every deployment for the declared workload by goodput under `slo` (default: epdserve/slo.py's,
    launch passes its --slo-ttft-ms / --slo-tpot-ms), devices counted per rank at `degrees`; the
    best one (see the module docstring)."""
    from epdserve.instance.modes import MODES
    from epdserve.perf.presets import PRESET_RATES, PRESETS
    from epdserve.planner import rank
    from epdserve.planner.costs import load_per_degree
    from epdserve.planner.shapes import shapes_from_preset

    if workload not in PRESETS:
        raise ValueError(f"--expected-workload must be one of {', '.join(PRESETS)}, got {workload!r}")
    rate = rate if rate is not None else PRESET_RATES.get(workload, (1.0, 1.0))[-1]
    if not rate > 0 or devices < 1:
        raise ValueError("--expected-rate must be > 0 and --devices >= 1")
    costs, _ = load_per_degree(profiles_for(model, device, profile, degrees, cache))
    colocated = device.startswith("cpu")  # one CPU host: every instance shares its cores
    shapes = shapes_from_preset(workload, rate, model, requests)
    ranked = rank.rank(costs, shapes, devices, colocated, MODES, slo or rank.DEFAULT_SLO, degrees=degrees)
    where = f"{devices} core group(s) of this host" if colocated else f"{devices} device(s)"
    at = f" at {degrees.flags()}" if not degrees.single else ""
    if not ranked:
        raise ValueError(f"--mode auto: no deployment fits {where}{at} (an instance of degree N takes N; "
                         f"raise --devices or lower the degrees)")
    d = ranked[0].deployment
    return StartPlan(d.mode, d.encode, d.prefill, d.decode, ranked[0].goodput,
                     f"{workload} at {rate:g} req/s on {where}{at}", d.devices_used)
