"""P→D with real engines across processes: a prefill-only engine here sends each layer's KV
during its forward (its LayerwiseSendConnector) over gloo to decode-only engines in subprocesses.

Done-when of issue 4: the KV each D holds equals, bit for bit, the KV the P engine computed,
and the tokens D decodes after importing it equal transformers' `generate`.
"""
from __future__ import annotations

import sys
import time

import pytest
import torch

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.engine.engine_request import EngineRequest
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
from epdserve.transfer.kv import (
    LayerwiseRecvConnector, LayerwiseSendConnector, PairState, RendezvousServer,
)
from epdserve.transfer.kv.checks import blocks_digest
from tests.transfer.test_kv_transfer import Peer, _cfg, _emit, _engine_commands
from tests.harness import PH

MAX_TOKENS = 8


class RecordingSendConnector(LayerwiseSendConnector):
    """The engine's own send connector, remembering each sent request's source blocks so the test
    can hash P's KV (block ids reach a connector only through the engine's calls)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.sources: dict[str, tuple[int, ...]] = {}

    def build_step(self, batch) -> None:
        self.sources.update((i.seq.request_id, tuple(i.block_ids)) for i in batch if i.end == i.seq.prompt_len)
        super().build_step(batch)


def _decode_engine_peer() -> None:
    """A decode-only engine: takes requests with RemotePrefill (blocks reserved, KV expected
    through its receive connector), gets P's first token, decodes."""
    torch.set_num_threads(1)
    rx = LayerwiseRecvConnector(sys.argv[2], _cfg())  # the instance id names its pairs
    eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", roles="D"), kv_connector=rx)
    prompt_blocks = {}
    for cmd in _engine_commands(rx):
        if cmd["cmd"] == "reserve":
            rid, ids = cmd["request_id"], cmd["prompt_token_ids"]
            sp = SamplingParams(max_tokens=cmd["max_tokens"], ignore_eos=True)
            eng.add_request(EngineRequest(rid, ids, [], sp, kv_transfer=RemotePrefill("p0")))
            prompt_blocks[rid] = (rx.reserved_blocks(rid), len(ids))
            _emit(event="reserved", request_id=rid, blocks=list(prompt_blocks[rid][0]))
        if cmd["cmd"] == "start":
            rx.set_first_token(cmd["request_id"], cmd["first_token"], cmd["rope_delta"])
        for out in eng.step():
            if out.finished:
                r = eng.load_report()
                _emit(event="finished", request_id=out.request_id, token_ids=out.token_ids, error=out.error,
                      digest=blocks_digest(eng.kv_cache, *prompt_blocks.pop(out.request_id)),
                      all_free=r["free_kv_blocks"] == r["total_kv_blocks"])


def _run(model_dir, requests: list[tuple[str, str, list, str]], n_decode: int) -> None:
    """requests: (request_id, prompt, images, decode peer name "d0".."dN"): all prefilled in one
    forward here, each KV sent to its decode peer, decoded there, checked against generate."""
    torch.set_num_threads(1)
    decoders = {f"d{i}": Peer("_decode_engine_peer", __name__, (str(model_dir), f"d{i}")) for i in range(n_decode)}
    tx = RecordingSendConnector(_cfg())
    p_eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="EP"), kv_connector=tx)
    server = RendezvousServer()
    try:
        for name, d in decoders.items():
            d.wait("up", timeout_s=60)
            d.send(cmd="connect", rdzv=server.rendezvous("unused").to_json())
            pair_name = d.wait("connecting")["pair_name"]
            tx.join(name, server.rendezvous(pair_name))
        deadline = time.monotonic() + 60
        while any(tx.pair_state(n) is not PairState.READY for n in decoders):
            assert time.monotonic() < deadline, "pairs did not connect"
            time.sleep(0.01)
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        for rid, prompt, images, peer in requests:
            req = p_eng.build_request(rid, prompt, images, sp)
            decoders[peer].send(cmd="reserve", request_id=rid, prompt_token_ids=req.prompt_token_ids,
                                max_tokens=MAX_TOKENS)
            req.kv_transfer = RemoteDecode(peer, tuple(decoders[peer].wait("reserved", request_id=rid)["blocks"]))
            p_eng.add_request(req)
        first = {}
        while len(first) < len(requests):
            assert time.monotonic() < deadline, "prefill did not finish"
            for out in p_eng.step():
                assert out.error is None and out.finished and out.finish_reason is None  # handed off
                first[out.request_id] = out
        assert len(tx.sources) == len(requests), "every request's KV left in one forward"
        while p_eng.has_pending_transfers():  # P holds the blocks until each D acknowledged
            assert time.monotonic() < deadline, "transfers did not finish"
            p_eng.step()
            time.sleep(0.002)
        ref = ReferenceGenerator(model_dir)
        last_free = {}
        for rid, prompt, images, peer in requests:
            src, n = tx.sources[rid], first[rid].num_prompt_tokens
            p_digest = blocks_digest(p_eng.kv_cache, src[: -(-n // p_eng.kv_cache.spec.block_size)], n)
            decoders[peer].send(cmd="start", request_id=rid, first_token=first[rid].token_ids[0],
                                rope_delta=first[rid].rope_delta)
            ev = decoders[peer].wait("finished", request_id=rid, timeout_s=60)
            assert ev["error"] is None
            assert ev["digest"] == p_digest, f"{rid}: D's KV differs from P's"
            assert ev["token_ids"] == ref.generate(prompt, images, MAX_TOKENS), rid
            last_free[peer] = ev["all_free"]
        assert all(last_free.values())  # each D freed every block once its last request finished
        r = p_eng.load_report()
        assert r["free_kv_blocks"] == r["total_kv_blocks"]
    finally:
        tx.close()
        server.close()
        for d in decoders.values():
            d.stop()


def _img(w, h, seed):
    return jpeg_bytes(procedural_image(w, h, seed))


def test_prefill_engine_to_one_decode_engine(tiny_model_dir):
    _run(tiny_model_dir, [
        ("img", f"what is in {PH} here, tell me", [_img(112, 84, 1)], "d0"),
        ("txt", "the quick brown fox jumps over the lazy dog " * 3, [], "d0"),
    ], n_decode=1)


@pytest.mark.slow  # 15-25 s on 2 cores: three processes load the model
def test_prefill_engine_to_two_decode_engines(qwen2_vl_tiny):
    _run(qwen2_vl_tiny, [
        ("a", f"compare {PH} and {PH}", [_img(56, 140, 2), _img(168, 112, 3)], "d0"),
        ("b", f"describe {PH} in detail", [_img(112, 112, 4)], "d1"),
    ], n_decode=2)
