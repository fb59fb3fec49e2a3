"""One part of `epdserve bench device`, in a process of its own (so a hang or a crash costs that
part only): `python -m epdserve.checks.device.part PART CONFIG_JSON_FILE RESULT_JSON_FILE`
(PART `prebuild`: only build the perf part's checkpoint, in the background of the other parts).

Owns `PARTS` (part name → the module that runs it and sums it up in one line) and the part's
process: it reads its `CheckConfig`, runs the part, keeps its figures in RESULT_JSON_FILE (rewritten
after each figure) and prints one `RESULT <part> <device> <line>` line at the end.
"""
from __future__ import annotations

import importlib
import json
import sys
import time

PARTS = {"exact": "epdserve.checks.device.exact", "serve": "epdserve.checks.device.serve",
         "perf": "epdserve.checks.device.perf", "tp": "epdserve.checks.device.tp",
         "graphs": "epdserve.checks.device.graphs"}


def summary(part: str, data: dict) -> str:
    """The one-line summary of a part's figures (perf: its JSON)."""
    mod = importlib.import_module(PARTS[part])
    fn = getattr(mod, "summary", None)
    return fn(data) if fn else json.dumps(data, default=str)


def main(argv: list[str] | None = None) -> int:
    from epdserve.checks.device.env import CheckConfig, PartResult

    part, config_path, result_path = (sys.argv[1:] if argv is None else argv)[:3]
    cfg = CheckConfig.from_json(open(config_path).read())
    if part == "prebuild":
        from epdserve.checks.device.env import checkpoint

        t0 = time.monotonic()
        print(f"built {checkpoint(cfg, 'qwen2_vl', cfg.perf_size)} in {time.monotonic() - t0:.1f} s", flush=True)
        return 0
    result = PartResult(part, result_path)
    t0 = time.monotonic()
    rc = 0
    try:
        importlib.import_module(PARTS[part]).run(cfg, result)
    except Exception as e:  # the part's failure, in its result; the other parts still run
        import traceback

        traceback.print_exc()
        result.set("error", f"{type(e).__name__}: {str(e)[:400]}")
        rc = 1
    result.set("elapsed_s", round(time.monotonic() - t0, 1))
    print(f"RESULT {part} {cfg.device} {summary(part, result.data)}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
