"""The role seams in one process: a prefill-only engine and a decode-only engine joined by the
layerwise KV connectors over a real gloo pair; the decode side continues exactly (oracle).

The P engine sends each layer's KV during its forward (`LayerwiseSendConnector`) into blocks
the D engine reserved when it took the request (`LayerwiseRecvConnector`); D decodes once the
KV and P's first token are both in. Both engines free every block at the end.
"""
import time

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.transfer.kv import KVTransferConfig, LayerwiseRecvConnector, LayerwiseSendConnector, RendezvousServer
from tests.engine.blocks import all_blocks_free
from tests.harness import PH

CFG = KVTransferConfig(timeout_s=20.0, bootstrap_timeout_s=20.0, connect_timeout_s=20.0)


def _until(cond, engines, timeout_s=30.0):
    outs, deadline = [], time.monotonic() + timeout_s
    while not cond(outs):
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            outs.extend(e.step())
        time.sleep(0.001)
    return outs


def test_prefill_only_then_decode_only(qwen2_5_vl_tiny):
    model = str(qwen2_5_vl_tiny)
    tx, rx = LayerwiseSendConnector(CFG), LayerwiseRecvConnector("d0", CFG)
    p_eng = LLMEngine(EngineConfig(model=model, device="cpu", roles="EP"), kv_connector=tx)
    d_eng = LLMEngine(EngineConfig(model=model, device="cpu", roles="D"), model=p_eng.model, kv_connector=rx)
    server = RendezvousServer()
    try:
        img = jpeg_bytes(procedural_image(112, 84, 9))
        prompt = f"describe {PH} in detail"
        sp = SamplingParams(max_tokens=9, ignore_eos=True)
        req = p_eng.build_request("r", prompt, [img], sp)
        rdzv = rx.pair_for("p0", server.host, server.port)
        tx.join("d0", rdzv.for_peer())
        d_eng.add_request(EngineRequest("r", req.prompt_token_ids, [], sp, kv_transfer=RemotePrefill("p0")))
        req.kv_transfer = RemoteDecode("d0", rx.reserved_blocks("r"))
        _until(lambda _: tx.pair_state("d0").value == "ready", [])
        p_eng.add_request(req)
        (first,) = _until(lambda o: o, [p_eng])
        assert first.finished and first.finish_reason is None and first.error is None  # handed off
        assert len(first.token_ids) == 1
        rx.set_first_token("r", first.token_ids[0], first.rope_delta)
        outs = _until(lambda o: any(x.finished for x in o), [d_eng])
        _until(lambda _: all_blocks_free(p_eng) and not p_eng.has_pending_transfers(), [p_eng])
        final = outs[-1]
        streamed = [t for o in outs for t in o.new_token_ids]
        expected = ReferenceGenerator(qwen2_5_vl_tiny).generate(prompt, [img], 9)
        assert final.error is None and final.token_ids == expected
        assert streamed == expected[1:]  # the first token came from the prefill side
        assert final.timings["kv_transfer_end"] <= final.timings["first_decode"]
        assert all_blocks_free(d_eng)
    finally:
        tx.close()
        rx.close()
        server.close()


def test_decode_side_reservation_is_refused_when_blocks_run_out(qwen2_5_vl_tiny):
    rx = LayerwiseRecvConnector("d0", CFG)
    d_eng = LLMEngine(EngineConfig(model=str(qwen2_5_vl_tiny), device="cpu", roles="D",
                                   kv_cache_bytes=1 << 16), kv_connector=rx)
    try:
        sp = SamplingParams(max_tokens=500, ignore_eos=True)
        try:
            d_eng.add_request(EngineRequest("big", list(range(100)), [], sp, kv_transfer=RemotePrefill("p0")))
        except MemoryError as e:
            assert "free KV blocks" in str(e)
        else:
            raise AssertionError("a reservation larger than the cache was taken")
        assert all_blocks_free(d_eng) and not d_eng.has_pending_transfers()
    finally:
        rx.close()
