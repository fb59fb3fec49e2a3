"""Reading the JSON reports the planner takes: `epdserve profile` and `epdserve bench serve` files."""
from __future__ import annotations

import json
from pathlib import Path


def read_report(path: str | Path, kind: str, error: type[Exception], label: str, what: str,
                missing_hint: str = "") -> dict:
    """The JSON object in `path`, whose "benchmark" is `kind`; `error` with a clear message otherwise
    (`label`: what the file is called in "LABEL PATH not found"; `what`: in "not an WHAT")."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{label} {path} not found{missing_hint}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(report, dict) or report.get("benchmark") != kind:
        raise error(f"{path}: not an {what} (no \"benchmark\": \"{kind}\")")
    return report
