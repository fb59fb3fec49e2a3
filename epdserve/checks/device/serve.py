"""`bench device` part `serve`: every deployment mode launched on the device, its greedy tokens
against the offline `LLM`'s on the same device.

Per mode: the seconds from `epdserve launch` to its ready line, how many prompts (one image, two
images, text only) came back token for token equal to offline, and the P→D KV hop the launcher
chose (`kv_hop=` of the ready line: device, host — a P and a D on one accelerator —, or "—" where
the mode has no P→D pair). The launcher starts its own password-protected MM Store (its password
reaches the children in their environment only). `serve_jobs` modes start at once (an accelerator
has room for several tiny deployments; on a small CPU host, 1).
"""
from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from epdserve.checks.device.env import (
    CheckConfig, PartResult, checkpoint, free_device_memory, greedy, llm_request, prompts,
)

HOP_RE = re.compile(r"\bkv_hop=(\w+)")


def run(cfg: CheckConfig, result: PartResult) -> None:
    from epdserve import LLM

    model = checkpoint(cfg, cfg.serve_arch)
    cases = prompts()
    llm = LLM(str(model), device=cfg.device, dtype="float32")
    want = [list(o.outputs[0].token_ids)
            for o in llm.generate([llm_request(p, imgs) for _, p, imgs in cases], greedy(cfg.serve_tokens))]
    del llm
    free_device_memory(cfg.device)
    lock = threading.Lock()

    def one(mode: str) -> None:
        entry = serve_mode(cfg, mode, str(model), cases, want)
        with lock:
            result.set(mode, entry)

    with ThreadPoolExecutor(max_workers=max(1, cfg.serve_jobs)) as pool:
        list(pool.map(one, cfg.modes))


def serve_mode(cfg: CheckConfig, mode: str, model: str, cases, want: list[list[int]]) -> dict:
    from epdserve.deploy.local.launched import LaunchError, launched
    from epdserve.client import Client

    logs = os.path.join(cfg.work_dir, "serve-logs")
    os.makedirs(logs, exist_ok=True)
    extra = ["--device", cfg.device, "--instance-args", "--dtype float32", "--kv-hop", cfg.kv_hop,
             "--log-dir", os.path.join(logs, mode)]
    t0 = time.monotonic()
    try:
        with launched(mode, model, extra, ready_timeout_s=max(5.0, cfg.left_s() - 10.0), log_dir=logs) as dep:
            m = HOP_RE.search(dep.ready_line)
            entry = {"ready_s": round(dep.ready_s, 1), "kv_hop": m.group(1) if m else "—"}
            got = []
            with Client(dep.address, timeout=120.0) as c:
                for _, prompt, imgs in cases:
                    out = c.generate(prompt, images=imgs, max_tokens=cfg.serve_tokens, temperature=0.0,
                                     ignore_eos=True)
                    got.append(list(out.token_ids))
            entry.update(equal=sum(g == w for g, w in zip(got, want)), of=len(cases))
            return entry
    except LaunchError as e:
        return {"error": f"not ready: {str(e)[-600:]}", "after_s": round(time.monotonic() - t0, 1)}
    except Exception as e:  # a failed request: the mode's failure, reported
        return {"error": f"{type(e).__name__}: {str(e)[:400]}", "after_s": round(time.monotonic() - t0, 1)}


def summary(data: dict) -> str:
    return ", ".join(f"{mode} {v['equal']}/{v['of']} ready {v['ready_s']}s hop={v['kv_hop']}"
                     if "equal" in v else f"{mode} FAILED" for mode, v in data.items() if isinstance(v, dict))
