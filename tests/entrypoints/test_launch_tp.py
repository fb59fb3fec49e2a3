"""`epdserve launch --mode monolithic` with a tensor-parallel instance (`--tensor-parallel-size 2`
through --instance-args; issue 47 items 2 and 6), as real processes on CPU: 16 concurrent requests
equal transformers' greedy `generate`; a rank killed while requests run takes its instance down
whole (exit 75), the launcher restarts it, the scheduler retries, and every request completes with
transformers' tokens."""
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
TOKENS = 24


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny, tmp_path_factory):
    dep = _launch("monolithic", qwen2_vl_tiny, ("--instance-args", "--tensor-parallel-size 2 --kv-cache-mb 64",
                                                "--log-dir", str(tmp_path_factory.mktemp("launch-tp"))))
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


def _ranks(dep) -> list[psutil.Process]:
    """The instance's tensor-parallel ranks other than 0 (processes of their own)."""
    return [p for p in psutil.Process(dep.proc.pid).children(recursive=True)
            if "epdserve.engine.tp_rank" in " ".join(p.cmdline())]


def _run(dep):
    with Client(dep.address, timeout=300) as c, ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(c.generate, p, images=im, max_tokens=TOKENS, ignore_eos=True) for p, im in workload()]
        return [f.result() for f in futs]


def test_16_concurrent_requests_match_transformers(deployment, references):
    assert len(_ranks(deployment)) == 1
    for (prompt, _), r in zip(workload(), _run(deployment)):
        assert r.token_ids == references[prompt], prompt


def test_a_killed_rank_restarts_the_instance_and_loses_no_request(deployment, references):
    victim = _ranks(deployment)[0]
    instance = deployment.instances()[0]
    stop = threading.Event()

    def keep_busy(c, tag):  # the 16 requests alone can all end before a poll sees one running
        outs = []
        while not stop.is_set():
            outs.append(c.generate(f"keep the instance busy {tag} {len(outs)}", max_tokens=48, ignore_eos=True))
        return outs

    with Client(deployment.address, timeout=300) as c, ThreadPoolExecutor(18) as pool:
        try:
            fillers = [pool.submit(keep_busy, c, i) for i in range(2)]
            futs = [pool.submit(c.generate, p, images=im, max_tokens=TOKENS, ignore_eos=True) for p, im in workload()]
            wait_until(lambda: status(stub(instance.address, TOKEN)).load.running_requests > 0, timeout_s=120,
                       what="the instance running requests")
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
    assert wait_until(lambda: len(_ranks(deployment)) == 1 and _ranks(deployment)[0].pid != victim.pid,
                      timeout_s=120, what="the restarted instance's rank 1")
