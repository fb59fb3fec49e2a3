"""Input and bounds of a launched deployment, over gRPC.

Bounds: a burst of 10x the scheduler's capacity gets RESOURCE_EXHAUSTED for the excess and every
admitted request finishes exactly; requests over an input limit are refused with their status
before any work (huge prompts do not hold the preprocessing threads: a normal request sent among
them is served).

Fuzzed requests (hypothesis, fixed seed, bounded examples): random `GenerateRequest`s — every field, extreme numbers, huge repeated fields, duplicate
request ids, chats of odd shapes, random and truncated bytes as images in every format PIL
writes, huge declared dimensions — and raw wire bytes (random, or a valid request truncated or
bit-flipped: invalid UTF-8, unknown fields). Each gets a clear status within its deadline: OK,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, or (bytes that do not parse as the message, refused by gRPC
before our code) UNKNOWN naming the parse error — never INTERNAL, never a hang. Afterwards the
deployment is healthy, a normal request is still exact, and no process's RSS grew past
RSS_GROWTH_BOUND."""
from __future__ import annotations

import io
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.client import Client, EPDServeError
from epdserve.model.reference import ReferenceGenerator
from epdserve.rpc import common_pb2, serve_pb2, serve_pb2_grpc
from tests.instance.harness import PH, image
from tests.reliability.helpers import family, kill_group, launch, wait_exit
from tests.reliability.test_limits import png_header

pytestmark = pytest.mark.slow

RSS_GROWTH_BOUND = 512 << 20  # per process, over the whole fuzz run
CALL_TIMEOUT_S = 120.0  # a hang shows as DEADLINE_EXCEEDED
CAPACITY = 3  # --max-requests
SCHEDULER_ARGS = (f"--max-requests {CAPACITY} --max-images 2 --max-prompt-bytes 100000 --max-message-bytes 2000000 "
                  "--max-image-pixels 1000000 --preprocess-threads 2")
FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
BURST_PROMPTS = ["Burst one.", "Burst two, longer than one.", "Burst three"]
MAX_TOKENS = 8
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FORMATS = ["PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "ICO", "TGA"]


@pytest.fixture(scope="module")
def deployment(qwen2_vl_tiny):
    dep = launch(qwen2_vl_tiny, "--mode", "monolithic", "--max-model-len", "256", "--scheduler-args", SCHEDULER_ARGS)
    procs = family(dep.proc.pid)
    dep.rss_before = {p.pid: p.memory_info().rss for p in procs}
    dep.procs = procs
    yield dep
    dep.proc.terminate()
    assert dep.proc.wait(60) == 0, dep.tail()
    wait_exit(procs, 10)
    kill_group(dep.proc)


@pytest.fixture(scope="module")
def seen() -> Counter:
    """Status codes the fuzzed requests got (to check the fuzzing reached both outcomes)."""
    return Counter()


@pytest.fixture(scope="module")
def stubs(deployment):
    ch = grpc.insecure_channel(deployment.address, options=[("grpc.max_send_message_length", 64 << 20)])
    raw = ch.unary_unary("/epdserve.v1.EPDServe/Generate", request_serializer=None, response_deserializer=None)
    yield serve_pb2_grpc.EPDServeStub(ch), raw
    ch.close()


@pytest.fixture(scope="module")
def references(qwen2_vl_tiny):
    """Greedy outputs of the burst prompts (transformers)."""
    gen = ReferenceGenerator(qwen2_vl_tiny)
    return {p: gen.generate(p, max_tokens=MAX_TOKENS) for p in BURST_PROMPTS}


def _outcome(c: Client, prompt: str):
    try:
        return c.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids
    except EPDServeError as e:
        return e.code


def test_a_burst_of_ten_times_capacity(deployment, references):
    n = 10 * CAPACITY
    prompts = [BURST_PROMPTS[i % len(BURST_PROMPTS)] for i in range(n)]
    with Client(deployment.address, timeout=300) as c, ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(lambda p: _outcome(c, p), prompts))
    served = [(p, o) for p, o in zip(prompts, outcomes) if isinstance(o, list)]
    refused = [o for o in outcomes if not isinstance(o, list)]
    assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
    assert len(served) >= CAPACITY
    for p, ids in served:
        assert ids == references[p]
    with Client(deployment.address, timeout=60) as c:
        assert c.server_info().requests_in_flight == 0
        assert _outcome(c, BURST_PROMPTS[0]) == references[BURST_PROMPTS[0]]


def _client_code(c: Client, prompt, images=None):
    try:
        c.generate(prompt, images=images, max_tokens=2)
    except EPDServeError as e:
        return e.code
    return grpc.StatusCode.OK


def test_input_limits_refuse_before_work_and_others_carry_on(deployment, references):
    huge = "word " * 100_000  # 500 kB, over --max-prompt-bytes
    with Client(deployment.address, timeout=300) as c, ThreadPoolExecutor(8) as pool:
        hogs = [pool.submit(_client_code, c, huge) for _ in range(6)]  # more than --preprocess-threads
        normal = pool.submit(_outcome, c, BURST_PROMPTS[1])
        assert [h.result() for h in hogs] == [grpc.StatusCode.INVALID_ARGUMENT] * 6
        assert normal.result() == references[BURST_PROMPTS[1]]
        img = image(3, 56, 56)
        assert _client_code(c, f"{PH}{PH}{PH}", [img] * 3) == grpc.StatusCode.INVALID_ARGUMENT  # --max-images 2
        assert _client_code(c, f"{PH}", [png_header(2000, 1000)]) == grpc.StatusCode.INVALID_ARGUMENT  # pixels
        assert _client_code(c, f"{PH}", [b"\xff" * 3_000_000]) == grpc.StatusCode.RESOURCE_EXHAUSTED  # message bytes
        assert _client_code(c, f"{PH}", [img]) == grpc.StatusCode.OK
        assert c.health() == "SERVING"


# ---------------------------------------------------------------- strategies
def _encoded(fmt: str, w: int, h: int, seed: int) -> bytes:
    im = Image.new("RGB", (w, h), ((seed * 37) % 256, (seed * 91) % 256, (seed * 13) % 256))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


@st.composite
def image_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "truncated", "random", "huge"]))
    if kind == "random":
        return draw(st.binary(max_size=2048))
    if kind == "huge":
        return png_header(draw(st.integers(1, 1 << 20)), draw(st.integers(1, 1 << 20)))
    data = _encoded(draw(st.sampled_from(FORMATS)), draw(st.integers(1, 96)), draw(st.integers(1, 96)),
                    draw(st.integers(0, 255)))
    return data if kind == "valid" else data[:draw(st.integers(0, max(0, len(data) - 1)))]


media = st.one_of(image_bytes().map(lambda d: common_pb2.Media(data=d)),
                  st.text(max_size=80).map(lambda k: common_pb2.Media(key=k)),
                  st.just(common_pb2.Media()))
int32 = st.integers(-(1 << 31), (1 << 31) - 1)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1e-300, -0.0, 1e300])


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams()
    if draw(st.booleans()):
        p.max_tokens = draw(int32 | st.integers(0, 32))
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            setattr(p, name, draw(floats))
    if draw(st.booleans()):
        p.top_k = draw(int32)
    if draw(st.booleans()):
        p.seed = draw(st.integers(-(1 << 63), (1 << 63) - 1))
    p.stop.extend(draw(st.lists(st.text(max_size=20), max_size=draw(st.sampled_from([3, 80])))))
    p.stop_token_ids.extend(draw(st.lists(int32, max_size=draw(st.sampled_from([3, 80])))))
    for name in ("ignore_eos", "skip_special_tokens"):
        if draw(st.booleans()):
            setattr(p, name, draw(st.booleans()))
    return p


prompt_text = st.lists(st.one_of(st.text(max_size=60), st.just(PH), st.just("<|image_pad|>"),
                                 st.just("<|im_start|>")), max_size=6).map("".join)


@st.composite
def chat(draw) -> serve_pb2.Chat:
    c = serve_pb2.Chat()
    if draw(st.booleans()):
        c.add_generation_prompt = draw(st.booleans())
    for _ in range(draw(st.integers(0, 5))):
        m = c.messages.add(role=draw(st.sampled_from(["user", "assistant", "system", "tool", ""]) | st.text(max_size=10)))
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["text", "image", "empty"]))
            if kind == "text":
                m.content.add(text=draw(prompt_text))
            elif kind == "image":
                m.content.add(image=draw(media))
            else:
                m.content.add()
    return c


@st.composite
def plausible(draw) -> serve_pb2.GenerateRequest:
    """A request that may well be served: placeholders matching valid images, sane sampling."""
    k = draw(st.integers(0, 2))
    text = draw(st.text(max_size=40).filter(lambda t: "<|" not in t))
    r = serve_pb2.GenerateRequest(prompt=text + PH * k, request_id=draw(st.text(max_size=10)))
    r.media.extend(common_pb2.Media(data=_encoded(draw(st.sampled_from(FORMATS)), draw(st.integers(8, 96)),
                                                  draw(st.integers(8, 96)), draw(st.integers(0, 255))))
                   for _ in range(k))
    r.sampling.max_tokens = draw(st.integers(1, 8))
    if draw(st.booleans()):
        r.sampling.temperature = draw(st.floats(0, 2))
        r.sampling.top_p = draw(st.floats(0.01, 1))
        r.sampling.top_k = draw(st.integers(0, 50))
        r.sampling.seed = draw(st.integers(-(1 << 63), (1 << 63) - 1))
    r.sampling.stop.extend(draw(st.lists(st.text(min_size=1, max_size=5), max_size=2)))
    r.sampling.ignore_eos = draw(st.booleans())
    return r


def requests():
    return st.one_of(plausible(), wild())


@st.composite
def wild(draw) -> serve_pb2.GenerateRequest:
    r = serve_pb2.GenerateRequest(request_id=draw(st.text(max_size=30)), sampling=draw(sampling()))
    kind = draw(st.sampled_from(["prompt", "ids", "chat", "none", "huge"]))
    if kind == "prompt":
        r.prompt = draw(prompt_text)
    elif kind == "ids":
        r.prompt_token_ids.ids.extend(draw(st.lists(int32 | st.integers(0, 200), max_size=40)))
    elif kind == "chat":
        r.chat.CopyFrom(draw(chat()))
    elif kind == "huge":  # huge repeated fields and texts: refused by the limits, before any work
        n = draw(st.sampled_from([300_000, 2_000_000]))
        which = draw(st.sampled_from(["prompt", "ids", "stop"]))
        if which == "prompt":
            r.prompt = "x" * n
        elif which == "ids":
            r.prompt_token_ids.ids.extend([1] * n)
        else:
            r.sampling.stop_token_ids.extend([1] * (n // 10))
    if kind != "chat":
        r.media.extend(draw(st.lists(media, max_size=draw(st.sampled_from([2, 6])))))
    if draw(st.integers(0, 9)) == 0:
        r.resume_token_ids.extend(draw(st.lists(int32, max_size=5)))
    return r


@st.composite
def wire_bytes(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    data = bytearray(draw(requests()).SerializeToString())
    if data and draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data) - 1))]
    for _ in range(draw(st.integers(0, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(data) + draw(st.sampled_from([b"", b"\xf8\x07\x01", b"\x9a\x3f\x02\xff\xfe"]))  # unknown fields


# ---------------------------------------------------------------- checks
def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _assert_clear(code: grpc.StatusCode, details: str, raw: bool = False) -> None:
    if raw and code == grpc.StatusCode.UNKNOWN:
        assert "Error parsing message" in details, details  # refused by gRPC's own deserialiser
        return
    assert code in CLEAR, f"{code.name}: {details}"
    if code != grpc.StatusCode.OK:
        assert details, "an error without a message"


@FUZZ
@given(req=requests())
def test_random_requests_get_a_clear_status(stubs, seen, req):
    stub, _ = stubs
    code, details = _status(lambda: stub.Generate(req, timeout=CALL_TIMEOUT_S))
    seen[code] += 1
    _assert_clear(code, details)


@FUZZ
@given(data=wire_bytes())
def test_random_wire_bytes_get_a_clear_status(stubs, data):
    _, raw = stubs
    _assert_clear(*_status(lambda: raw(data, timeout=CALL_TIMEOUT_S)), raw=True)


@FUZZ
@given(req=requests(), copies=st.integers(2, 4))
def test_duplicate_request_ids_in_flight(stubs, req, copies):
    stub, _ = stubs
    req.request_id = req.request_id or "dup"
    with ThreadPoolExecutor(copies) as pool:
        for code, details in pool.map(lambda _: _status(lambda: stub.Generate(req, timeout=CALL_TIMEOUT_S)),
                                      range(copies)):
            _assert_clear(code, details)


def test_afterwards_healthy_exact_and_bounded(deployment, seen, qwen2_vl_tiny):
    assert seen[grpc.StatusCode.OK] and seen[grpc.StatusCode.INVALID_ARGUMENT], seen
    ref = ReferenceGenerator(qwen2_vl_tiny).generate(f"Look {PH} here.", [image(4, 56, 84)], max_tokens=8)
    with Client(deployment.address, timeout=120, retries=0) as c:
        assert c.health() == "SERVING"
        assert all(i.health == common_pb2.HEALTHY for i in c.server_info().instances)
        assert c.generate(f"Look {PH} here.", images=[image(4, 56, 84)], max_tokens=8,
                          ignore_eos=True).token_ids == ref
    for p in deployment.procs:
        grown = p.memory_info().rss - deployment.rss_before[p.pid]
        assert grown < RSS_GROWTH_BOUND, f"{p.cmdline()[:6]} grew by {grown >> 20} MiB"
    assert psutil.Process(deployment.proc.pid).is_running()
