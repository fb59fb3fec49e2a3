"""A prefill-only engine and a decode-only engine at different tensor-parallel degrees, joined by
the layerwise KV connectors over one real gloo group of every rank of both (each rank other than
0 its own process, engine/tp_rank.py): D continues exactly what transformers generates (issue 48
item 3), with an image, and a second turn reuses D's prefix cache across the degrees (only the
blocks D lacks cross).

The tiny checkpoint has 4 attention heads and 2 KV heads: at TP4 each KV head lives on two
ranks, so the P TP4 case sends every head from one of its two holders, and the D TP4 case
receives each head on two ranks.
"""
from functools import partial

import pytest

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
from epdserve.seams.prefix_hash import media_extra
from epdserve.transfer.kv import KVTransferConfig, LayerwiseRecvConnector, LayerwiseSendConnector, RendezvousServer
from tests.engine.blocks import all_blocks_free
from tests.engine.test_engine_roles import _until as _step_until
from tests.harness import PH

_until = partial(_step_until, timeout_s=120.0)  # rank processes on two cores: more time than one engine
CFG = KVTransferConfig(timeout_s=30.0, bootstrap_timeout_s=60.0, connect_timeout_s=60.0)


class Fleet:
    """Prefill and decode engines at several degrees, built once for the module (each rank other
    than 0 is a process: five tests starting their own would spend most of their time loading);
    every P pairs with every D it meets through one connector each."""

    def __init__(self, model: str):
        self.model = model
        self.server = RendezvousServer()
        self.p: dict[int, tuple[LLMEngine, LayerwiseSendConnector]] = {}
        self.d: dict[int, tuple[LLMEngine, LayerwiseRecvConnector]] = {}

    def prefill(self, tp: int):
        if tp not in self.p:
            tx = LayerwiseSendConnector(CFG)
            self.p[tp] = (LLMEngine(EngineConfig(model=self.model, device="cpu", roles="EP", dtype="float32",
                                                 tensor_parallel_size=tp), kv_connector=tx), tx)
        return self.p[tp]

    def decode(self, tp: int):
        if tp not in self.d:
            rx = LayerwiseRecvConnector(f"d{tp}", CFG)
            self.d[tp] = (LLMEngine(EngineConfig(model=self.model, device="cpu", roles="D", dtype="float32",
                                                 tensor_parallel_size=tp, enable_prefix_caching=True),
                                    kv_connector=rx), rx)
        return self.d[tp]

    def close(self) -> None:
        for eng, conn in [*self.p.values(), *self.d.values()]:
            eng.close()
            conn.close()
        self.server.close()


@pytest.fixture(scope="module")
def fleet(qwen2_5_vl_tiny):
    f = Fleet(str(qwen2_5_vl_tiny))
    yield f
    f.close()


def _turn(fleet, p_tp, d_tp, rid, prompt, images, sp):
    """One request from P TP`p_tp` to D TP`d_tp`; returns (D's final output, every token: P's first, then D's)."""
    (p_eng, tx), (d_eng, rx) = fleet.prefill(p_tp), fleet.decode(d_tp)
    p_name, d_name = f"p{p_tp}", f"d{d_tp}"
    req = p_eng.build_request(rid, prompt, images, sp)
    rdzv = rx.pair_for(p_name, fleet.server.host, fleet.server.port, p_tp)
    tx.join(d_name, rdzv.for_peer())
    media = tuple((m.key, media_extra(m.grid_thw), m.num_tokens) for m in req.media)  # D's prefix cache keys
    d_eng.add_request(EngineRequest(rid, req.prompt_token_ids, [], sp, kv_transfer=RemotePrefill(p_name),
                                    media_identity=media))
    req.kv_transfer = RemoteDecode(d_name, rx.reserved_blocks(rid), rx.cached_tokens(rid))
    _until(lambda _: tx.pair_state(d_name).value == "ready", [])
    p_eng.add_request(req)
    (first,) = _until(lambda o: o, [p_eng])
    assert first.error is None and len(first.token_ids) == 1, first.error
    rx.set_first_token(rid, first.token_ids[0], first.rope_delta)
    outs = _until(lambda o: any(x.finished for x in o), [d_eng])
    _until(lambda _: all_blocks_free(p_eng) and not p_eng.has_pending_transfers(), [p_eng])
    return outs[-1], [first.token_ids[0]] + [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_decode_continues_exactly_across_degrees(fleet, qwen2_5_vl_tiny, p_tp, d_tp):
    img = jpeg_bytes(procedural_image(112, 84, 9))
    prompt = f"describe {PH} in detail"
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = ReferenceGenerator(qwen2_5_vl_tiny)
    final, tokens = _turn(fleet, p_tp, d_tp, f"r{p_tp}{d_tp}", prompt, [img], sp)
    assert final.error is None and final.token_ids == tokens == ref.generate(prompt, [img], 6)
    d_eng, rx = fleet.decode(d_tp)
    if (p_tp, d_tp) == (2, 2):  # a second turn: D's prefix cache holds the first turn's blocks
        tx = fleet.prefill(p_tp)[1]
        before = (tx.counters.bytes, tx.counters.bytes_skipped, rx.counters.bytes, rx.counters.bytes_skipped)
        prompt2 = prompt + " and then some more words about it, at length, one by one"
        final2, tokens2 = _turn(fleet, p_tp, d_tp, "turn2", prompt2, [img], sp)
        assert final2.error is None and tokens2 == ref.generate(prompt2, [img], 6)
        sent, spared, got, kept = (now - was for now, was in zip(
            (tx.counters.bytes, tx.counters.bytes_skipped, rx.counters.bytes, rx.counters.bytes_skipped), before))
        assert spared == kept > 0 and sent == got > 0  # only the blocks D lacked crossed
    _until(lambda _: all_blocks_free(d_eng), [d_eng])
