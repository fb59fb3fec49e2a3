"""`epdserve launch --mode E-P-D` with the prefill and the decode instance at tensor-parallel size 2
(`--prefill-tensor-parallel-size 2 --decode-tensor-parallel-size 2`; issue 48 items 3 and 4), as
real processes on CPU: every rank of P sends its own KV heads to the D ranks holding them, so 16
concurrent requests (most with images) equal transformers' greedy `generate`; a D rank, then a P
rank, SIGKILLed while transfers run takes its instance down whole (exit 75), the launcher restarts
it, the scheduler retries, and every request still completes with transformers' tokens."""
from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from epdserve.client import Client
from tests.entrypoints.test_launch import TOKEN, _kill, _launch, workload
from tests.hf_oracle import HFOracle
from tests.instance.harness import status, stub, wait_until

pytestmark = pytest.mark.slow
TOKENS = 16


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny, tmp_path_factory):
    dep = _launch("E-P-D", qwen2_vl_tiny, ("--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "2",
                                           "--log-dir", str(tmp_path_factory.mktemp("launch-tp-hop"))))
    try:
        yield dep
        dep.proc.send_signal(signal.SIGTERM)
        assert dep.proc.wait(120) == 0, "".join(dep.output[-40:])
    finally:
        if dep.proc.poll() is None:
            _kill(dep.proc)


@pytest.fixture(scope="module")
def references(qwen2_vl_tiny):
    gen = HFOracle(qwen2_vl_tiny)
    return {prompt: gen.generate(prompt, images, TOKENS, ignore_eos=True) for prompt, images in workload()}


def _ranks(dep, roles: str) -> list[psutil.Process]:
    """The tensor-parallel ranks other than 0 of every live instance serving `roles` (E-P-D runs two D)."""
    out = []
    for inst in dep.instances():
        if inst.roles != roles:
            continue
        try:
            out += [p for p in psutil.Process(inst.pid).children(recursive=True)
                    if "epdserve.engine.tp_rank" in " ".join(p.cmdline())]
        except (psutil.Error, OSError):  # the roster still names an instance that ended
            pass
    return out


def _run(dep):
    with Client(dep.address, timeout=300) as c, ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(c.generate, p, images=im, max_tokens=TOKENS, ignore_eos=True) for p, im in workload()]
        return [f.result() for f in futs]


def test_16_requests_cross_from_p_tp2_to_d_tp2_exactly(deployment, references):
    assert len(_ranks(deployment, "P")) == 1 and len(_ranks(deployment, "D")) == 2  # one P, two D, at TP2 each
    for (prompt, _), r in zip(workload(), _run(deployment)):
        assert r.token_ids == references[prompt], prompt


@pytest.mark.parametrize("side", ["D", "P"])
def test_a_rank_killed_mid_hop_loses_no_request(deployment, references, side):
    """A rank other than 0 of a D (then of the P) instance SIGKILLed while requests cross: its
    instance exits whole (75) and restarts, the scheduler retries, nothing is lost."""
    victim = _ranks(deployment, side)[0]
    inst = next(i for i in deployment.instances() if i.pid == victim.ppid())  # the instance whose rank dies
    stop = threading.Event()

    def keep_busy(c, tag):  # the 16 requests alone can all end before a poll sees one running
        outs = []
        while not stop.is_set():
            outs.append(c.generate(f"keep the instances busy {tag} {len(outs)}", max_tokens=48, ignore_eos=True))
        return outs

    def crossing() -> bool:  # D holds requests whose KV is arriving; P has had a batch acknowledged
        load = status(stub(inst.address, TOKEN)).load
        return load.running_requests > 0 if side == "D" else load.kv_sent_bytes > sent_before

    sent_before = status(stub(inst.address, TOKEN)).load.kv_sent_bytes
    with Client(deployment.address, timeout=300) as c, ThreadPoolExecutor(18) as pool:
        try:
            fillers = [pool.submit(keep_busy, c, i) for i in range(2)]
            futs = [pool.submit(c.generate, p, images=im, max_tokens=TOKENS, ignore_eos=True) for p, im in workload()]
            wait_until(crossing, timeout_s=120, what=f"KV crossing at the {side} instance")
            os.kill(victim.pid, signal.SIGKILL)
            results = [f.result() for f in futs]
        finally:
            stop.set()  # else the pool's exit waits for the fillers forever
        kept = [r for f in fillers for r in f.result()]
    for (prompt, _), r in zip(workload(), results):
        assert r.token_ids == references[prompt], prompt
    assert kept and all(r.usage.output_tokens == 48 for r in kept)  # the fillers lost nothing either
    logs = deployment.log_dir
    instance_log = "".join(p.read_text(errors="replace") for p in logs.glob("*.log") if "scheduler" not in p.name)
    assert re.search(r"the instance exits \(status 75\) to be restarted whole", instance_log), instance_log[-3000:]
    scheduler_log = (logs / "scheduler.log").read_text(errors="replace")
    assert re.search(r"retrying", scheduler_log) and "giving up" not in scheduler_log, scheduler_log[-3000:]
    want = {"D": 2, "P": 1}[side]
    assert wait_until(lambda: len(_ranks(deployment, side)) == want
                      and victim.pid not in {p.pid for p in _ranks(deployment, side)},
                      timeout_s=120, what=f"the restarted {side} instance's rank 1")
