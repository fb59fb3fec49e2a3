"""n > 1 as one sequence group (sampling.n) through a scheduler and instance *processes*, P-D (a
real P->D KV transfer, two D) and monolithic (one EPD): greedy choices each equal the offline
engine's output, itself checked against transformers' `generate` (the `offline` fixture); a
coupled instance's Generate stream carries every choice's tokens under its index and ends after
the last one finished; a choice ended by its first token ends alone; what n cannot do (out of
1..128, the unary Generate, a resumed group) is INVALID_ARGUMENT; and a D that fails the group
after P handed it off (ABORTED, as a failed KV import answers) or is killed mid-group loses no
choice: each unfinished choice resumes alone, after its own output (the output unchanged)."""
import signal

import grpc
import pytest

import epdserve.entrypoints.instance_cli  # noqa: F401  an import regression fails here, never skips the file
from epdserve import Client
from epdserve.metrics.serving import ServingMetrics
from epdserve.rpc import common_pb2, instance_pb2, instance_pb2_grpc, serve_pb2, serve_pb2_grpc
from tests.scheduler.harness import instance_deployment

pytestmark = pytest.mark.slow

MODES = {"P-D": (("p0", "P"), ("d0", "D"), ("d1", "D")), "monolithic": (("epd0", "EPD"),)}
PROMPT = "Three choices of one prompt, prefilled once"


@pytest.fixture(scope="module", params=sorted(MODES))
def deployment(request, qwen2_vl_tiny):
    with instance_deployment(qwen2_vl_tiny, MODES[request.param], observer=ServingMetrics()) as (sched, procs, _):
        yield request.param, sched, procs


def _instance(sched, iid):
    return sched.call(lambda: sched.server.registry.get(iid))


def test_greedy_choices_each_equal_transformers(deployment, offline):
    _, sched, _ = deployment
    want = offline(PROMPT, [], 12, ignore_eos=True)
    with Client(sched.address, timeout=300) as c:
        got = c.generate_choices(PROMPT, n=3, max_tokens=12, ignore_eos=True)
    assert [g.token_ids for g in got] == [want] * 3
    assert [g.usage.output_tokens for g in got] == [12] * 3  # each choice's own count
    assert len({g.usage.prompt_tokens for g in got}) == 1


@pytest.mark.parametrize("deployment", ["monolithic"], indirect=True)
def test_coupled_generate_streams_each_choice_under_its_index(deployment):
    _, sched, _ = deployment
    rec = _instance(sched, "epd0")
    req = instance_pb2.InstanceGenerateRequest(request_id="group-1", prompt_token_ids=[11, 52, 93, 52, 11, 7],
                                               sampling=common_pb2.SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    with grpc.insecure_channel(rec.address) as ch:
        deltas = list(instance_pb2_grpc.InstanceStub(ch).Generate(req, timeout=120))
    per = {j: [t for d in deltas if d.index == j for t in d.token_ids] for j in range(3)}
    assert {j: len(t) for j, t in per.items()} == {0: 5, 1: 5, 2: 5} and per[0] == per[1] == per[2]
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2]
    assert deltas[-1].finished and all(d.request_id == "group-1" for d in deltas)


def test_what_n_cannot_do_is_invalid_argument_naming_it(deployment):
    _, sched, _ = deployment

    def req(**kw):
        return serve_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4, **kw))

    with grpc.insecure_channel(sched.address) as ch:
        stub = serve_pb2_grpc.EPDServeStub(ch)
        def stream(x, timeout):
            return list(stub.GenerateStream(x, timeout=timeout))

        for r, says in ((req(n=0), "sampling.n"), (req(n=129), "sampling.n"), (req(n=2), "GenerateStream")):
            with pytest.raises(grpc.RpcError) as e:
                (stub.Generate if says == "GenerateStream" else stream)(r, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details()
        resumed = req(n=2)
        resumed.resume_token_ids.extend([11])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.GenerateStream(resumed, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume_token_ids" in e.value.details()


def _upto(ids: list[int], stop: int) -> list[int]:
    return ids[: ids.index(stop) + 1] if stop in ids else ids


def test_a_choice_ended_by_its_first_token_ends_alone(deployment):
    """Choice 0's first token is a stop token (in P-D it ends at P): the others decode on, each
    its seeded output up to that token."""
    _, sched, _ = deployment
    kw = dict(max_tokens=8, ignore_eos=True, temperature=1.0)
    with Client(sched.address, timeout=300) as c:
        seed = next(s for s in range(100) if len({g.token_ids[0] for g in c.generate_choices(
            PROMPT, n=3, max_tokens=1, temperature=1.0, seed=s)}) == 3)  # three different first tokens
        free = c.generate_choices(PROMPT, n=3, seed=seed, **kw)
        stop = free[0].token_ids[0]
        got = c.generate_choices(PROMPT, n=3, seed=seed, stop_token_ids=[stop], **kw)
    assert got[0].token_ids == [stop] and got[0].finish_reason == "stop"
    assert [g.token_ids for g in got[1:]] == [_upto(g.token_ids, stop) for g in free[1:]]
    assert all(g.finish_reason == ("stop" if stop in g.token_ids else "length") for g in got)


def _running(sched) -> dict[str, int]:
    out = {}
    for iid in ("d0", "d1"):
        with grpc.insecure_channel(_instance(sched, iid).address) as ch:
            out[iid] = instance_pb2_grpc.InstanceStub(ch).GetLoad(instance_pb2.GetLoadRequest(),
                                                                  timeout=10).load.running_requests
    return out


def _group_stream(sched, ch, request_id: str, max_tokens: int):
    req = serve_pb2.GenerateRequest(request_id=request_id, prompt=PROMPT, sampling=common_pb2.SamplingParams(
        n=3, max_tokens=max_tokens, ignore_eos=True))
    return serve_pb2_grpc.EPDServeStub(ch).GenerateStream(req, timeout=300)


@pytest.mark.parametrize("deployment", ["P-D"], indirect=True)
def test_d_failing_the_group_after_p_handed_it_off_resumes_each_choice(deployment, offline):
    """D fails the group mid-decode with ABORTED (what a failed KV import answers, P having handed
    choices 1..n-1 off with their first tokens): each choice resumes alone, output unchanged."""
    _, sched, _ = deployment
    retries = sched.server.observer.registry.get_sample_value
    before = retries("epdserve:request_retries_total") or 0
    toks: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with grpc.insecure_channel(sched.address) as ch:
        stream = _group_stream(sched, ch, "failing-group", 200)
        for d in stream:
            toks[d.index].extend(d.token_ids)
            if all(len(t) >= 2 for t in toks.values()):
                break
        running = _running(sched)
        holder = max(running, key=running.get)
        assert running[holder] == 3
        with grpc.insecure_channel(_instance(sched, holder).address) as ich:  # the attempt's id there: "<id>#1"
            stub = instance_pb2_grpc.InstanceStub(ich)
            assert stub.Abort(instance_pb2.InstanceAbortRequest(request_id="failing-group#1"), timeout=10).found
        for d in stream:
            toks[d.index].extend(d.token_ids)
    want = offline(PROMPT, [], 200, ignore_eos=True)
    assert toks == {0: want, 1: want, 2: want}
    assert retries("epdserve:request_retries_total") - before == 3  # one attempt per choice after the group's


@pytest.mark.parametrize("deployment", ["P-D"], indirect=True)
def test_d_killed_mid_group_each_choice_resumes_alone(deployment, offline):
    _, sched, procs = deployment
    toks: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with grpc.insecure_channel(sched.address) as ch:
        stream = _group_stream(sched, ch, "killed-group", 200)
        for d in stream:  # every choice past its first decode step: the group is on one D
            toks[d.index].extend(d.token_ids)
            if all(len(t) >= 2 for t in toks.values()):
                break
        running = _running(sched)
        victim = max(running, key=running.get)
        assert running[victim] == 3  # the group's three choices, decoding there
        procs[victim].send_signal(signal.SIGKILL)
        ends = []
        for d in stream:
            toks[d.index].extend(d.token_ids)
            if d.finished:
                ends.append((d.index, d.finish_reason, d.usage.output_tokens))
    want = offline(PROMPT, [], 200, ignore_eos=True)
    assert toks == {0: want, 1: want, 2: want}
    assert sorted(ends) == [(j, "length", 200) for j in range(3)]
    assert sched.server.observer.registry.get_sample_value("epdserve:request_retries_total") >= 1
