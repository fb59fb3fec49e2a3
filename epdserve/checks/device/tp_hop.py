"""`bench device` part `tp`, its hop: a prefill engine at tensor_parallel_size 2 (ranks on devices
0 and 1) sends each prompt's KV to a decode engine at 1 through the layerwise KV connectors
(issue 48 item 5) — every P rank its own KV heads, over NCCL / HCCL when D has a device of its own
(a third one), over the host-staged hop when it shares device 0 with P's rank 0 (two devices:
NCCL and HCCL refuse two ranks of a group on one device), gloo on the CPU. D's greedy tokens
against transformers' on one device, per prompt, and the KV bytes that crossed.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from epdserve.checks.device.env import CheckConfig, checkpoint, free_device_memory, greedy, prompts
from epdserve.checks.device.exact import agreement

P_DEGREE = 2


def hop_placement(device: str, count: int) -> tuple[str, str, str]:
    """(P's device, D's device, the KV hop) for `count` visible devices of kind `device`."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return "cpu", "cpu", "device"
    if count > P_DEGREE:
        return f"{kind}:0", f"{kind}:{P_DEGREE}", "device"
    return f"{kind}:0", f"{kind}:0", "host"


def run_hop(cfg: CheckConfig, count: int) -> dict:
    """P TP2 → D TP1 over the checkpoint's dense family; the figures of `result.set`."""
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.engine_request import EngineRequest
    from epdserve.engine.llm_engine import LLMEngine
    from epdserve.model.reference import ReferenceGenerator
    from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
    from epdserve.transfer.kv import KVTransferConfig, LayerwiseRecvConnector, LayerwiseSendConnector, RendezvousServer

    p_dev, d_dev, hop = hop_placement(cfg.device, count)
    d = checkpoint(cfg, "qwen2_vl")
    cases = prompts()
    ref = ReferenceGenerator(d, device=cfg.device, dtype=torch.float32)
    want = [ref.generate(p, imgs, max_tokens=cfg.exact_tokens) for _, p, imgs in cases]
    del ref
    free_device_memory(cfg.device)
    kv_cfg = KVTransferConfig(timeout_s=60.0, bootstrap_timeout_s=120.0, connect_timeout_s=120.0, hop=hop)
    tx, rx = LayerwiseSendConnector(kv_cfg), LayerwiseRecvConnector("d0", kv_cfg)
    server, engines, outs = RendezvousServer(), [], []
    try:
        p_eng = LLMEngine(EngineConfig(model=str(d), device=p_dev, roles="EP", dtype="float32",
                                       tensor_parallel_size=P_DEGREE), kv_connector=tx)
        engines.append(p_eng)
        d_eng = LLMEngine(EngineConfig(model=str(d), device=d_dev, roles="D", dtype="float32"), kv_connector=rx)
        engines.append(d_eng)
        sp = greedy(cfg.exact_tokens)
        for i, (_, prompt, imgs) in enumerate(cases):
            rid = f"hop{i}"
            req = p_eng.build_request(rid, prompt, imgs, sp)
            tx.join("d0", rx.pair_for("p0", server.host, server.port, P_DEGREE).for_peer())
            d_eng.add_request(EngineRequest(rid, req.prompt_token_ids, [], sp, kv_transfer=RemotePrefill("p0")))
            req.kv_transfer = RemoteDecode("d0", rx.reserved_blocks(rid))
            _until(lambda _: tx.pair_state("d0").value == "ready", [])  # every rank of both has joined
            p_eng.add_request(req)
            first = _until(lambda o: o, [p_eng])[0]
            if first.error is not None:
                raise RuntimeError(f"prefill of {rid}: {first.error}")
            rx.set_first_token(rid, first.token_ids[0], first.rope_delta)
            outs.append(_until(lambda o: any(x.finished for x in o), [d_eng])[-1])
            _until(lambda _: not p_eng.has_pending_transfers(), [p_eng])
        finals = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=o.token_ids)], error=o.error) for o in outs]
        return {**agreement(cases, finals, want, cfg.exact_tokens), "p_devices": f"{p_dev} + {P_DEGREE - 1} more",
                "d_device": d_dev, "hop": hop, "kv_bytes": tx.counters.bytes}
    finally:
        for e in engines:
            e.close()
        tx.close()
        rx.close()
        server.close()
        free_device_memory(cfg.device)


def _until(cond, engines, timeout_s: float = 300.0) -> list:
    outs, deadline = [], time.monotonic() + timeout_s
    while not cond(outs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no progress within {timeout_s:g} s")
        for e in engines:
            outs.extend(e.step())
        time.sleep(0.001)
    return outs
