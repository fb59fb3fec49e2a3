"""`epdserve doctor`: what this machine has for epdserve, as a table, and what to fix.

Rows: python, torch, torch_npu (version matches torch? imports?), CANN (from
$ASCEND_HOME_PATH/<arch>-linux/ascend_toolkit_install.info), CUDA, devices of the platform,
the mode's instances (with --mode), one instance's tensor-parallel degree (with
--tensor-parallel-size: enough devices from its index on; with --model: the degree splits the
model), the dist backend for the P->D KV hop, the native paged
operators (built for this torch or not; nothing is built), the HCCL / Gloo environment, the
MM Store (--mm-store: does it answer INFO; else: can launch start a private one) and
the scheduler (--scheduler: does GetServerInfo answer). Nothing is installed or started.

Exit status 1 when something the given --mode (or --device) needs is missing, an installed
torch_npu does not match torch or does not import, or a server named on the command line does
not answer; each warn / fail row is followed by its fix in one line.
"""
from __future__ import annotations

from epdserve.commands import add_command
from epdserve.engine.config import EngineConfig
from epdserve.instance.modes import MODES
from epdserve.settings import add_flags


def add_parser(subparsers) -> None:
    p = add_command(subparsers, "doctor", run, "check this machine (and named servers) for epdserve", __doc__)
    p.add_argument("--mode", choices=MODES, default=None, help="fail when this deployment mode cannot run here")
    p.add_argument("--mm-store", default=None, help="redis://host:port of an MM Store that must answer")
    p.add_argument("--scheduler", default=None, help="HOST:PORT of a scheduler that must answer")
    add_flags(p, EngineConfig, ["device", "tensor_parallel_size", "quantization"])
    p.add_argument("--model", default=None,
                   help="a checkpoint directory: fail when --tensor-parallel-size does not split it")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each named server")


def run(args) -> int:
    from epdserve.checks.doctor import Status, run_checks  # torch: not imported for --help

    checks = run_checks(mode=args.mode, mm_store=args.mm_store, scheduler=args.scheduler, device=args.device,
                        timeout_s=args.timeout, tensor_parallel_size=args.tensor_parallel_size, model=args.model,
                        quantization=args.quantization)
    print(format_table(checks))
    fixes = [c for c in checks if c.status is not Status.OK and c.fix]
    if fixes:
        print()
        for c in fixes:
            print(f"fix {c.name}: {c.fix}")
    failed = sum(c.status is Status.FAIL for c in checks)
    warned = sum(c.status is Status.WARN for c in checks)
    print(f"\nepdserve doctor: {len(checks) - failed - warned} ok, {warned} warn, {failed} fail")
    return 1 if failed else 0


def format_table(checks) -> str:
    """`checks`: `epdserve.checks.doctor.Check`s, as a table."""
    rows = [("check", "status", "detail")] + [(c.name, c.status.value, c.detail) for c in checks]
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    lines.insert(1, f"{'-' * w0}  {'-' * w1}  {'-' * 6}")
    return "\n".join(lines)
