"""P→D with real engines across processes: a prefill-only engine here sends each layer's KV
during its forward (runner layer hook) over gloo to decode-only engines in subprocesses.

Done-when of issue 4: the KV each D holds equals, bit for bit, the KV the P engine computed,
and the tokens D decodes after importing it equal transformers' `generate`.
"""
from __future__ import annotations

import queue
import sys
import time

import pytest
import torch

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.llm_engine import LLMEngine
from epdserve.model.demo_images import jpeg_bytes, procedural_image
from epdserve.model.reference import ReferenceGenerator
from epdserve.transfer.kv import KVReceiver, KVSender, RecvRequest, RendezvousServer, SendRequest, TransferState
from epdserve.transfer.kv.checks import blocks_digest
from tests.transfer.test_kv_transfer import Peer, _cfg, _commands, _emit

PH = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 8


class LayerwiseHook:
    """Runner layer hook: at layer 0 of a forward that completes reserved prompts, open a batch;
    after every layer, send that layer (the engine wiring in miniature)."""

    def __init__(self, engine: LLMEngine, sender: KVSender):
        self.engine, self.sender = engine, sender
        self.dest: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.open = False
        engine.runner.layer_hooks.append(self)

    def __call__(self, layer: int, batch) -> None:
        if layer == 0:
            reqs = []
            for item in batch:
                rid, seq = item.seq.request_id, item.seq
                if item.end == seq.prompt_len and rid in self.dest:
                    peer, dst = self.dest.pop(rid)
                    src = tuple(self.engine.blocks.table(rid)[: len(dst)])
                    reqs.append(SendRequest(rid, peer, src, dst, seq.prompt_len))
            if reqs:
                self.sender.begin_batch(reqs)
                self.open = True
        if self.open:
            self.sender.save_layer(layer)
            self.open = layer < self.engine.adapter.num_layers - 1


def _decode_engine_peer() -> None:
    """A decode-only engine: reserves blocks, imports KV through KVReceiver, decodes."""
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", roles="D"))
    rx = KVReceiver(eng.kv_cache, eng.platform, _cfg())
    cmds, prompt_blocks, kv_digest, starts = _commands(), {}, {}, {}
    _emit(event="up")
    while True:
        try:
            cmd = cmds.get(timeout=0.002)
        except queue.Empty:
            cmd = {"cmd": None}
        if cmd["cmd"] == "quit":
            rx.close()
            return
        if cmd["cmd"] == "connect":
            from epdserve.transfer.kv import PairRendezvous

            pair = rx.connect("p0", PairRendezvous.from_json(cmd["rdzv"]))
            _emit(event="ready" if pair.wait_ready(30) else "connect_failed", error=pair.error)
        if cmd["cmd"] == "reserve":
            rid, n = cmd["request_id"], cmd["prompt_len"]
            table = eng.blocks.grow(rid, n + cmd["max_tokens"])
            prompt_blocks[rid] = (tuple(table[: eng.blocks.blocks_needed(n)]), n)
            rx.expect(RecvRequest(rid, "p0", *prompt_blocks[rid]))
            _emit(event="reserved", request_id=rid, blocks=list(prompt_blocks[rid][0]))
        if cmd["cmd"] == "start":
            starts[cmd["request_id"]] = cmd
        for st in rx.pop_finished():
            if st.state is TransferState.DONE:
                kv_digest[st.request_id] = blocks_digest(eng.kv_cache, *prompt_blocks[st.request_id])
            else:
                eng.blocks.free(st.request_id)
                _emit(event="finished", request_id=st.request_id, error=st.error)
        for rid in [r for r in starts if r in kv_digest]:
            c = starts.pop(rid)
            sp = SamplingParams(max_tokens=c["max_tokens"], ignore_eos=True)
            eng.add_prefilled_request(rid, c["prompt_token_ids"], c["rope_delta"], c["first_token"], sp)
            eng.kv_ready(rid)
        if eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    _emit(event="finished", request_id=out.request_id, token_ids=out.token_ids, error=out.error,
                          digest=kv_digest.pop(out.request_id), num_free=eng.blocks.num_free,
                          num_blocks=eng.blocks.num_blocks)


def _run(model_dir, requests: list[tuple[str, str, list, str]], n_decode: int) -> None:
    """requests: (request_id, prompt, images, decode peer name "d0".."dN"): all prefilled in one
    forward here, each KV sent to its decode peer, decoded there, checked against generate."""
    torch.set_num_threads(1)
    decoders = {f"d{i}": Peer("_decode_engine_peer", __name__, (str(model_dir),)) for i in range(n_decode)}
    p_eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="EP"))
    server = RendezvousServer()
    tx = KVSender(p_eng.kv_cache, p_eng.platform, _cfg())
    hook = LayerwiseHook(p_eng, tx)
    try:
        for name, d in decoders.items():
            d.wait("up", timeout_s=60)
            rdzv = server.rendezvous(f"p0-{name}/g0")
            pair = tx.connect(name, rdzv)
            d.send(cmd="connect", rdzv=rdzv.for_peer().to_json())
            assert pair.wait_ready(30), pair.error
            d.wait("ready")
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        for rid, prompt, images, peer in requests:
            p_eng.add_request(rid, prompt, images, sp)
            n = p_eng._seqs[rid].prompt_len
            decoders[peer].send(cmd="reserve", request_id=rid, prompt_len=n, max_tokens=MAX_TOKENS)
            hook.dest[rid] = (peer, tuple(decoders[peer].wait("reserved", request_id=rid)["blocks"]))
        first = {}
        deadline = time.monotonic() + 60
        while len(first) < len(requests):
            assert time.monotonic() < deadline, "prefill did not finish"
            for out in p_eng.step():
                assert out.error is None and out.finish_reason == "prefill_done"
                first[out.request_id] = out.token_ids[0]
        assert not hook.dest, "every request's KV left in one forward"
        done = {}
        while len(done) < len(requests):
            assert time.monotonic() < deadline, "transfers did not finish"
            done.update((st.request_id, st) for st in tx.pop_finished())
            time.sleep(0.005)
        ref = ReferenceGenerator(model_dir)
        last_free = {}
        for rid, prompt, images, peer in requests:
            assert done[rid].state is TransferState.DONE, done[rid].error
            seq = p_eng._seqs[rid]
            p_blocks = p_eng.blocks.table(rid)[: p_eng.blocks.blocks_needed(seq.prompt_len)]
            p_digest = blocks_digest(p_eng.kv_cache, p_blocks, seq.prompt_len)
            decoders[peer].send(cmd="start", request_id=rid, prompt_token_ids=seq.prompt_token_ids,
                                rope_delta=seq.rope_delta, first_token=first[rid], max_tokens=MAX_TOKENS)
            p_eng.release(rid)
            ev = decoders[peer].wait("finished", request_id=rid, timeout_s=60)
            assert ev["error"] is None
            assert ev["digest"] == p_digest, f"{rid}: D's KV differs from P's"
            assert ev["token_ids"] == ref.generate(prompt, images, MAX_TOKENS), rid
            last_free[peer] = (ev["num_free"], ev["num_blocks"])
        assert all(free == total for free, total in last_free.values())
        assert p_eng.blocks.num_free == p_eng.blocks.num_blocks
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
