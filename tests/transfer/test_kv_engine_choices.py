"""n > 1 across P→D with real engines (engine/sequence_group.py): P prefills the prompt once and
draws the n first tokens; its KV crosses once, over a real gloo pair, to a decode-only engine in a
subprocess, which forks the n choices on it. Each choice equals the single request P-D serves
with its seed (seed + j), greedy choices equal transformers' `generate`, the group's KV bytes
equal a single request's, and both sides free every block."""
from __future__ import annotations

import sys
import time

import torch

from epdserve import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.engine_request import EngineRequest
from epdserve.engine.llm_engine import LLMEngine
from epdserve.seams.kv_connector import RemoteDecode, RemotePrefill
from epdserve.transfer.kv import LayerwiseRecvConnector, LayerwiseSendConnector, PairState, \
    RendezvousServer
from tests.hf_oracle import HFOracle
from tests.transfer.test_kv_transfer import Peer, _cfg, _emit, _engine_commands

PROMPT = "a prompt for three choices, prefilled once and sent once"
MAX_TOKENS = 6


def _decode_choices_peer() -> None:
    """A decode-only engine: reserves a request (n choices) for P's KV, takes P's first tokens, decodes."""
    torch.set_num_threads(1)
    rx = LayerwiseRecvConnector(sys.argv[2], _cfg())
    eng = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", roles="D", enable_prefix_caching=False),
                    kv_connector=rx)
    for cmd in _engine_commands(rx):
        if cmd["cmd"] == "reserve":
            rid = cmd["request_id"]
            eng.add_request(EngineRequest(rid, cmd["prompt_token_ids"], [], SamplingParams(**cmd["params"]),
                                          kv_transfer=RemotePrefill("p0")))
            _emit(event="reserved", request_id=rid, blocks=list(rx.reserved_blocks(rid)))
        if cmd["cmd"] == "start":
            rx.set_first_token(cmd["request_id"], cmd["first_token"], cmd["rope_delta"], cmd["choice_tokens"])
        for out in eng.step():
            if out.finished:
                r = eng.load_report()
                _emit(event="finished", request_id=out.request_id, index=out.index, token_ids=list(out.token_ids),
                      error=out.error, all_free=r["free_kv_blocks"] == r["total_kv_blocks"],
                      kv_bytes=rx.counters.bytes)


def _serve(model_dir, requests: dict[str, dict]) -> tuple[dict, dict, int]:
    """requests: id -> SamplingParams kwargs. Returns ({id: {index: tokens}}, {id: KV bytes sent}, D's
    free-block check) after P prefilled each, sent its KV to D and D decoded every choice."""
    torch.set_num_threads(1)
    d = Peer("_decode_choices_peer", __name__, (str(model_dir), "d0"))
    tx = LayerwiseSendConnector(_cfg())
    p_eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", roles="EP", enable_prefix_caching=False),
                      kv_connector=tx)
    server = RendezvousServer()
    results, sent, all_free = {}, {}, False
    try:
        d.wait("up", timeout_s=60)
        d.send(cmd="connect", rdzv=server.rendezvous("unused").to_json())
        tx.join("d0", server.rendezvous(d.wait("connecting")["pair_name"]))
        deadline = time.monotonic() + 120
        while tx.pair_state("d0") is not PairState.READY:
            assert time.monotonic() < deadline, "pair did not connect"
            time.sleep(0.01)
        for rid, kw in requests.items():  # one at a time: each one's KV bytes apart
            params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
            req = p_eng.build_request(rid, PROMPT, [], SamplingParams(**params))
            d.send(cmd="reserve", request_id=rid, prompt_token_ids=req.prompt_token_ids, params=params)
            req.kv_transfer = RemoteDecode("d0", tuple(d.wait("reserved", request_id=rid)["blocks"]))
            before = tx.counters.bytes
            p_eng.add_request(req)
            n, firsts = params.get("n", 1), {}
            while len(firsts) < n:
                assert time.monotonic() < deadline, "prefill did not finish"
                for out in p_eng.step():
                    assert out.error is None and out.finished and out.finish_reason is None  # handed off
                    assert out.request_id == rid and len(out.token_ids) == 1
                    firsts[out.index] = out
            while p_eng.has_pending_transfers():
                assert time.monotonic() < deadline, "transfer did not finish"
                p_eng.step()
                time.sleep(0.002)
            sent[rid] = tx.counters.bytes - before
            d.send(cmd="start", request_id=rid, first_token=firsts[0].token_ids[0], rope_delta=firsts[0].rope_delta,
                   choice_tokens=[firsts[j].token_ids[0] for j in range(1, n)])
            results[rid] = {}
            for _ in range(n):
                ev = d.wait("finished", request_id=rid, timeout_s=60)
                assert ev["error"] is None
                results[rid][ev["index"]] = ev["token_ids"]
                all_free = ev["all_free"]
        r = p_eng.load_report()
        assert r["free_kv_blocks"] == r["total_kv_blocks"]
    finally:
        tx.close()
        server.close()
        d.stop()
    return results, sent, all_free


def test_choices_cross_once_and_equal_single_requests(qwen2_vl_tiny):
    sampled = dict(temperature=1.0, frequency_penalty=0.3)
    reqs = {f"s{j}": dict(seed=21 + j, **sampled) for j in range(3)}
    reqs |= {"group": dict(seed=21, n=3, **sampled), "greedy": dict(n=3)}
    results, sent, all_free = _serve(qwen2_vl_tiny, reqs)
    assert [results["group"][j] for j in range(3)] == [results[f"s{j}"][0] for j in range(3)]
    assert len({tuple(results[f"s{j}"][0]) for j in range(3)}) > 1, "the seeds should give different outputs"
    want = HFOracle(qwen2_vl_tiny).generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [results["greedy"][j] for j in range(3)] == [want] * 3
    assert sent["group"] == sent["greedy"] == sent["s0"] > 0  # one KV transfer for all n
    assert all_free


def _steps(engines, until, limit_s: float = 60.0) -> list:
    outs, deadline = [], time.monotonic() + limit_s
    while not until(outs):
        assert time.monotonic() < deadline, "no progress"
        for e in engines:
            outs.extend(e.step())
    return outs


def test_decode_side_group_aborted_or_stopped_by_a_first_token_frees_every_block(qwen2_vl_tiny):
    from epdserve.bench.kv_prefix_reuse import PDPair

    pair = PDPair(qwen2_vl_tiny, d_cache=False)
    try:
        ids = pair.p.build_request("x", PROMPT, [], SamplingParams()).prompt_token_ids
        # aborted while its KV is awaited: every choice ends, every reserved block is free again
        pair.d.add_request(EngineRequest("a", ids, [], SamplingParams(max_tokens=8, n=3),
                                         kv_transfer=RemotePrefill("p0")))
        assert pair.d.load_report()["free_kv_blocks"] < pair.d.load_report()["total_kv_blocks"]
        pair.d.abort("a")
        ends = _steps([pair.d], lambda o: len(o) >= 3)
        assert sorted((o.index, o.finish_reason) for o in ends) == [(j, "abort") for j in range(3)]
        _steps([pair.d], lambda _: not pair.d.has_pending_transfers())
        r = pair.d.load_report()
        assert r["free_kv_blocks"] == r["total_kv_blocks"]
        # one choice's first token (P's) is a stop token: it ends on arrival, the others decode on
        sp = dict(max_tokens=MAX_TOKENS, ignore_eos=True, n=3, temperature=1.0, seed=4)
        pair.p.add_request(pair.p.build_request("b", PROMPT, [], SamplingParams(**sp)))  # P alone: the first tokens
        firsts = {o.index: o.token_ids[0] for o in _steps([pair.p], lambda o: len(o) >= 3)}
        stopped = next((j for j in (1, 2) if firsts[j] != firsts[0]), None)
        assert stopped is not None, "the seeds should give different first tokens"
        params = SamplingParams(**sp, stop_token_ids=[firsts[stopped]])
        pair.d.add_request(EngineRequest("c", ids, [], params, kv_transfer=RemotePrefill("p0")))
        req = pair.p.build_request("c", PROMPT, [], params)
        req.kv_transfer = RemoteDecode("d0", pair.rx.reserved_blocks("c"), pair.rx.cached_tokens("c"))
        pair.p.add_request(req)
        f = {o.index: o for o in _steps([pair.p], lambda o: len(o) >= 3)}
        assert f[stopped].finish_reason == "stop" and f[0].finish_reason is None
        pair.rx.set_first_token("c", f[0].token_ids[0], f[0].rope_delta, [f[j].token_ids[0] for j in (1, 2)])
        ends = {o.index: o for o in _steps([pair.p, pair.d], lambda o: sum(x.finished for x in o) >= 3) if o.finished}
        assert ends[stopped].finish_reason == "stop" and ends[stopped].token_ids == [firsts[stopped]]
        for j in set(range(3)) - {stopped}:  # on to max_tokens, or until they sample the stop token themselves
            o = ends[j]
            assert o.token_ids[0] == f[j].token_ids[0] and o.error is None
            assert len(o.token_ids) == MAX_TOKENS or (o.finish_reason == "stop" and o.token_ids[-1] == firsts[stopped])
        _steps([pair.p, pair.d], lambda _: not pair.p.has_pending_transfers() and not pair.d.has_unfinished())
        for e in (pair.p, pair.d):
            r = e.load_report()
            assert r["free_kv_blocks"] == r["total_kv_blocks"]
    finally:
        pair.close()
