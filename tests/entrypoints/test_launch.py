"""`epdserve launch --config configs/<mode>.yaml` for each of the six modes, as real processes on
CPU with the tiny demo model, called through `epdserve.Client` and the OpenAI HTTP front; launched
by docs/openai.md's launch line (its config swapped for each mode's), so that the structured-output
cases of `tests/entrypoints/structured_cases.py`, imported below, run on the same deployments.

One deployment per mode (module-scoped, torn down before the next starts): its teardown sends
SIGTERM to the launcher and checks that it exits 0 and that none of its processes is left
(E-PD's launcher is SIGKILLed instead: its children must still exit, told by PR_SET_PDEATHSIG).
E-P-D runs two D instances so that one can be killed mid-run (the file's last test, so it runs
last in that mode's group).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from epdserve.client import Client, EPDServeError
from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc
from tests.entrypoints.structured_cases import docs_launch_args
from tests.hf_oracle import HFOracle
from tests.instance.harness import PH, image, status, stub, wait_until
from tests.security.test_forged_identity import IMAGE_PROMPT, forged_chat
from tests.security.xxh3_forge import colliding_ppms

pytestmark = pytest.mark.slow

MODES = ["monolithic", "P-D", "E-P-D", "EP-D", "ED-P", "E-PD"]
EXTRA = {"E-P-D": ["--decode", "2"]}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
READY = re.compile(r"^epdserve ready: grpc://(?P<address>\S+) mode=(?P<mode>\S+).* http=(?P<http>http://\S+)")
MAX_TOKENS = 8
TOKEN = "launch-test-cluster-token"  # the deployments' cluster token: instance addresses and calls need it


@dataclass
class Deployed:
    mode: str
    address: str
    proc: subprocess.Popen
    output: list[str]
    http: str  # the OpenAI front's URL
    log_dir: Path | None = None  # --log-dir: the children's logs (scheduler.log, ...)

    def instances(self):
        """The roster as a holder of the cluster token sees it (addresses included)."""
        with grpc.insecure_channel(self.address) as ch:
            info = serve_pb2_grpc.EPDServeStub(ch).GetServerInfo(serve_pb2.GetServerInfoRequest(), timeout=30,
                                                                metadata=[("epdserve-cluster-token", TOKEN)])
        return list(info.instances)

    def kv_instances(self):
        return [i for i in self.instances() if "P" in i.roles or "D" in i.roles]


def _launch(mode: str, model: Path, extra: tuple[str, ...] = ()) -> Deployed:
    flags = [str(model) if a == "/tmp/demo" else a for a in docs_launch_args(CONFIGS / f"{mode}.yaml")]
    argv = [sys.executable, "-m", "epdserve.entrypoints.cli", "launch", *flags, "--kv-cache-mb", "16", "--feature-wait-s", "20", *EXTRA.get(mode, []), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1", EPDSERVE_CLUSTER_TOKEN=TOKEN))
    output: list[str] = []
    ready = threading.Event()
    found: dict[str, str] = {}

    def drain():
        for line in proc.stdout:
            output.append(line)
            m = READY.match(line)
            if m and not ready.is_set():
                found.update(m.groupdict())
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(600) or "address" not in found:
        _kill(proc)
        raise AssertionError(f"launch --mode {mode} never printed its ready line:\n{''.join(output[-40:])}")
    assert found["mode"] == mode
    log_dir = Path(extra[extra.index("--log-dir") + 1]) if "--log-dir" in extra else None
    return Deployed(mode, found["address"], proc, output, found["http"], log_dir)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="module", params=MODES)
def deployment(request, qwen2_vl_tiny, tmp_path_factory):
    dep = _launch(request.param, qwen2_vl_tiny, ("--log-dir", str(tmp_path_factory.mktemp(f"launch-{request.param}"))))
    family = [psutil.Process(dep.proc.pid), *psutil.Process(dep.proc.pid).children(recursive=True)]
    def alive():
        return [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    try:
        yield dep
        if dep.mode == "E-PD":  # the launcher killed outright: its children still go (PR_SET_PDEATHSIG)
            dep.proc.send_signal(signal.SIGKILL)
            dep.proc.wait(30)
            wait_until(lambda: not alive(), timeout_s=120, what="the children of a killed launcher to exit")
        else:
            dep.proc.send_signal(signal.SIGTERM)
            assert dep.proc.wait(120) == 0, "".join(dep.output[-40:])
            left = alive()
            assert not left, f"processes left behind: {[p.cmdline()[:6] for p in left]}"
    finally:
        if dep.proc.poll() is None:
            _kill(dep.proc)


def workload() -> list[tuple[str, list[bytes]]]:
    """16 prompts: every fourth text-only, the others with 1-3 images of varied sizes."""
    out = []
    for i in range(16):
        k = 0 if i % 4 == 0 else 1 + i % 3
        text = f"Request {i}: " + " and ".join(PH for _ in range(k)) + (" describe." if k else " say hi.")
        out.append((text, [image(100 + 10 * i + j, 56 + 28 * ((i + j) % 3), 56 + 28 * (j % 2)) for j in range(k)]))
    return out


@pytest.fixture(scope="module")
def references(qwen2_vl_tiny):
    """transformers' own processor and greedy `generate` (`tests.hf_oracle`) on each prompt."""
    gen = HFOracle(qwen2_vl_tiny)
    refs = {prompt: gen.generate(prompt, images, MAX_TOKENS, ignore_eos=True) for prompt, images in workload()}
    refs["kill"] = {prompt: gen.generate(prompt, images, 24, ignore_eos=True) for prompt, images in workload()}
    refs["gen"] = gen
    return refs


def _images_encoded(dep: Deployed) -> int:
    return sum(status(stub(i.address, TOKEN)).load.images_encoded for i in dep.instances())


def _all_blocks_free(dep: Deployed) -> bool:
    loads = [status(stub(i.address, TOKEN)).load for i in dep.kv_instances()]
    return all(x.free_kv_blocks == x.total_kv_blocks for x in loads)


def test_16_concurrent_requests_match_transformers(deployment, references):
    with Client(deployment.address, timeout=300) as c, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda w: c.generate(w[0], images=w[1], max_tokens=MAX_TOKENS, ignore_eos=True),
                                workload()))
    for (prompt, images), r in zip(workload(), results):
        assert r.token_ids == references[prompt], prompt
        assert r.finish_reason == "length" and r.usage.output_tokens == MAX_TOKENS
        assert (r.usage.vision_tokens > 0) == bool(images)


def test_same_image_twice_is_served_from_the_mm_store(deployment):
    img = image(7000 + MODES.index(deployment.mode), 84, 84)
    before = _images_encoded(deployment)
    with Client(deployment.address, timeout=120) as c:
        first = c.generate(f"Once {PH} more", images=[img], max_tokens=4)
        second = c.generate(f"Once {PH} more", images=[img], max_tokens=4)
    assert second.token_ids == first.token_ids
    assert first.usage.cached_vision_tokens == 0 < first.usage.vision_tokens
    assert second.usage.cached_vision_tokens == second.usage.vision_tokens
    assert _images_encoded(deployment) - before == 1  # the encoder ran once, in whichever instance


def test_second_turn_reuses_the_first_turns_kv_exactly(deployment, references):
    """A conversation's next turn re-sends its history and image: the prefilling instance takes the
    history's KV from its prefix cache, and the tokens are still transformers' greedy ones."""
    img = image(7100 + MODES.index(deployment.mode), 112, 84)
    turn1 = f"Turn one about {PH}, please describe what you see in some detail for the record."
    with Client(deployment.address, timeout=120) as c:
        first = c.generate(turn1, images=[img], max_tokens=MAX_TOKENS, ignore_eos=True)
        turn2 = turn1 + first.text + " And what else is there?"
        second = c.generate(turn2, images=[img], max_tokens=MAX_TOKENS, ignore_eos=True)
    assert first.usage.cached_tokens == 0 < second.usage.cached_tokens
    assert second.usage.cached_tokens % 16 == 0 and second.usage.cached_tokens < second.usage.prompt_tokens
    assert second.token_ids == references["gen"].generate(turn2, [img], MAX_TOKENS, ignore_eos=True)


def test_corrupt_image_fails_only_its_request(deployment):
    with Client(deployment.address, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        good = [pool.submit(c.generate, f"Good {i} {PH}", images=[image(900 + i)], max_tokens=4) for i in range(3)]
        bad = pool.submit(c.generate, f"Bad {PH}", images=[image(950)[:60]], max_tokens=4)
        with pytest.raises(EPDServeError) as e:
            bad.result()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert all(f.result().finish_reason == "length" for f in good)


def test_cancelled_stream_frees_its_kv_blocks(deployment):
    assert wait_until(lambda: _all_blocks_free(deployment), what="an idle deployment")
    with Client(deployment.address, timeout=120) as c:
        stream = c.generate_stream(f"Cancel {PH} me", images=[image(960)], max_tokens=2000, ignore_eos=True)
        got = 0
        for delta in stream:
            got += len(delta.token_ids)
            if got >= 2:
                assert not _all_blocks_free(deployment)  # the request holds blocks while it runs
                break  # leaving the loop cancels the call
    assert wait_until(lambda: _all_blocks_free(deployment), what="blocks freed on P and D after the cancel")


@pytest.fixture(scope="module")
def forgeries(references):
    """Issue 35's attacks (tests/security/test_forged_identity.py) and the answers their victims are
    owed, from transformers' own processor and `generate` (`tests.hf_oracle`)."""
    gen = references["gen"]
    a, b = colliding_ppms()
    chat, _, forged = forged_chat(gen.tokenizer)
    return dict(a=a, b=b, chat=chat, forged=forged,
                want_a=gen.generate(IMAGE_PROMPT, [a], MAX_TOKENS, ignore_eos=True),
                want_b=gen.generate(IMAGE_PROMPT, [b], MAX_TOKENS, ignore_eos=True),
                want_chat=gen.generate(chat, [], MAX_TOKENS, ignore_eos=True))


def test_forged_identities_get_their_own_answers(deployment, forgeries):
    """Two images with one xxh3-128 sent B then A, and a first block forged against the old xxh3-64
    block hash sent before a chat: each victim gets transformers' answer for its own input."""
    f = forgeries
    with Client(deployment.address, timeout=120) as c:
        got_b = c.generate(IMAGE_PROMPT, images=[f["b"]], max_tokens=MAX_TOKENS, ignore_eos=True)
        got_a = c.generate(IMAGE_PROMPT, images=[f["a"]], max_tokens=MAX_TOKENS, ignore_eos=True)
        c.generate(f["forged"], max_tokens=MAX_TOKENS, ignore_eos=True)
        got_chat = c.generate(f["chat"], max_tokens=MAX_TOKENS, ignore_eos=True)
    got = {"B": got_b.token_ids, "A": got_a.token_ids, "chat": got_chat.token_ids}
    assert got == {"B": f["want_b"], "A": f["want_a"], "chat": f["want_chat"]}
    assert got_a.media_keys != got_b.media_keys


def test_instances_answer_health_and_report_their_roles(deployment):
    roles = sorted(i.roles for i in deployment.instances())
    want = {"monolithic": ["EPD"], "E-P-D": ["D", "D", "E", "P"], "EP-D": ["D", "EP"], "ED-P": ["ED", "P"],
            "E-PD": ["E", "PD"], "P-D": ["D", "P+E"]}[deployment.mode]
    assert roles == want
    for i in deployment.instances():
        assert i.health == common_pb2.HEALTHY
        assert status(stub(i.address, TOKEN)).instance_id == i.instance_id


# the structured-output cases on these deployments (imported here, before the kill below, which
# runs last in its mode's group); pytest collects the names a module holds
from tests.entrypoints.structured_cases import (  # noqa: E402,F401
    deployed, reference, test_a_bad_constraint_is_a_400_naming_its_field, test_a_resumed_request_replays_its_output_into_the_grammar,
    test_auto_tool_calls_are_parsed_whole_and_streamed, test_docs_examples_run_as_pasted,
    test_greedy_under_a_grammar_equals_transformers, test_named_tool_choice_is_a_structured_output_on_its_parameters,
    test_openai_parse_with_a_pydantic_model, test_readme_openai_examples_run_as_pasted,
    test_tool_choice_none_leaves_the_tools_out_and_a_tool_round_trip_renders,
    test_twenty_requests_half_with_an_image_are_schema_valid, test_vllm_extras_and_grpc_keyword)


@pytest.mark.parametrize("deployment", ["E-P-D"], indirect=True)  # its two D instances
def test_killing_one_of_two_decode_instances_loses_no_request(deployment, references):
    decoders = [i for i in deployment.instances() if i.roles == "D"]
    assert len(decoders) == 2
    with Client(deployment.address, timeout=300) as c, ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(c.generate, p, images=im, max_tokens=24, ignore_eos=True) for p, im in workload()]
        def holding(d) -> bool:  # requests reserved there (KV on its way) or decoding: 16 x 24 tokens end fast
            load = status(stub(d.address, TOKEN)).load
            return load.running_requests + load.waiting_requests > 0

        victim = wait_until(lambda: next((d for d in decoders if holding(d)), None), timeout_s=120,
                            what="a D instance holding requests")
        os.kill(victim.pid, signal.SIGKILL)
        results = [f.result() for f in futs]
    for (prompt, _), r in zip(workload(), results):
        assert r.token_ids == references["kill"][prompt], prompt
    # the requests the victim held were re-dispatched: the scheduler logged each retry, and gave up on none
    log = (deployment.log_dir / "scheduler.log").read_text(errors="replace")
    assert re.search(r"attempt 1 failed .*; retrying", log), log[-3000:]
    assert "giving up" not in log
    assert not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE
