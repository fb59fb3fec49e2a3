"""Loopback as a boundary a web page cannot cross, and one caller cannot crowd out the rest
(issue 39), tried as an attacker would against a real scheduler and its HTTP front on loopback.

- DNS rebinding: a page whose name now resolves to 127.0.0.1 sends ``Host: evil.example``:
  400, on every route (/metrics, /health, /v1 alike); loopback names and --allowed-hosts pass.
- A cross-origin ``text/plain`` (or form) POST, which needs no CORS preflight: 415.
- /metrics on a keyed loopback front needs the scrape token; a client API key does not open it.
- One /v1/completions call with 40 prompts (which held every admission slot): 400.
- Stop strings count in the prompt's byte budget.
"""
from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from epdserve.entrypoints.fronts import Fronts
from epdserve.entrypoints.http import HttpOptions
from epdserve.limits import InputLimits
from epdserve.scheduler import SchedulerConfig, SchedulerThread
from epdserve.security import Secret
from epdserve.security.options import SchedulerSecurity

KEY, SCRAPE = "sk-fence-test", "scrape-fence-test"


@pytest.fixture(autouse=True)
def _no_env_secrets(no_env_secrets):
    """Every test here runs without credentials from the environment (conftest.py)."""


@pytest.fixture(scope="module")
def sched(qwen2_vl_tiny):
    s = SchedulerThread(SchedulerConfig(model=str(qwen2_vl_tiny), limits=InputLimits(max_prompt_bytes=4096)))
    s.start()
    yield s
    s.stop()


def started(sched, opts: HttpOptions, security=None, token=None) -> Fronts:
    fronts = Fronts(opts, security=security or SchedulerSecurity(), metrics_auth="auto")
    fronts.metrics_token = token
    asyncio.run_coroutine_threadsafe(fronts.start(sched.server), sched.loop).result(30)
    return fronts


@pytest.fixture(scope="module")
def open_front(sched):
    """The default: no key, on loopback."""
    fronts = started(sched, HttpOptions(allowed_hosts="epd.internal"))
    yield fronts.http
    asyncio.run_coroutine_threadsafe(fronts.stop(), sched.loop).result(30)


@pytest.fixture(scope="module")
def keyed_front(sched):
    fronts = started(sched, HttpOptions(api_key=KEY, metrics_token=SCRAPE), SchedulerSecurity(api_key=Secret(KEY)),
                     SCRAPE)
    yield fronts.http
    asyncio.run_coroutine_threadsafe(fronts.stop(), sched.loop).result(30)


def call(front, method, path, body=None, headers=None):
    host, port = front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data.startswith(b"{") else data


def completion(front, body, key=None, content_type="application/json"):
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {key}"} if key else {})}
    return call(front, "POST", "/v1/completions", json.dumps(body), headers)


def test_a_rebound_host_name_is_refused_on_every_route(open_front):
    for method, path, body in (("GET", "/metrics", None), ("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}))):
        status, got = call(open_front, method, path, body, {"Host": "evil.example:8000",
                                                            "Content-Type": "application/json"})
        assert status == 400 and "Host" in got["error"]["message"], (path, got)
    port = open_front.address.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "epd.internal", f"[::1]:{port}", "[::1]"):
        assert call(open_front, "GET", "/health", headers={"Host": host})[0] == 200  # loopback, --allowed-hosts
    # a loopback name with anything but :PORT after it is not loopback (the text after it was ignored)
    for host in ("[::1]evil.example", "[::1]:80evil", "[::1", "localhost:evil.example", "127.0.0.1:"):
        status, got = call(open_front, "GET", "/health", headers={"Host": host})
        assert status == 400 and "Host" in got["error"]["message"], (host, got)


def test_a_post_that_is_not_json_is_refused(open_front):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, got = completion(open_front, {"prompt": "hi", "max_tokens": 1}, content_type=content_type)
        assert status == 415 and got["error"]["type"] == "UnsupportedMediaTypeError", got
    status, got = call(open_front, "POST", "/v1/completions", json.dumps({"prompt": "hi"}))  # no Content-Type
    assert status == 415


def test_a_cross_site_upload_form_is_refused_but_the_files_api_is_not(open_front):
    """/v1/files takes multipart (OpenAI's Files API), which a cross-site form can send: a browser's
    Origin naming a host off the allow-list is refused before the body is read; a client without
    one (the openai client sends none) reaches the route, whose own checks answer."""
    body = b"--x\r\nContent-Disposition: form-data; name=purpose\r\n\r\nvision\r\n--x--\r\n"
    form = {"Content-Type": "multipart/form-data; boundary=x"}
    status, got = call(open_front, "POST", "/v1/files", body, {**form, "Origin": "http://evil.example"})
    assert status == 403 and "cross-site" in got["error"]["message"], got
    status, got = call(open_front, "POST", "/v1/files", body, form)
    assert status == 400 and got["error"]["param"] == "file", got  # past the fence: the route says the file part is missing
    port = open_front.address.rsplit(":", 1)[1]
    status, got = call(open_front, "POST", "/v1/files", body, {**form, "Origin": f"http://127.0.0.1:{port}"})
    assert status == 400 and got["error"]["param"] == "file", got


def test_metrics_on_a_keyed_loopback_front_need_the_scrape_token(keyed_front):
    assert call(keyed_front, "GET", "/metrics")[0] == 401
    assert call(keyed_front, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})[0] == 401
    status, text = call(keyed_front, "GET", "/metrics", headers={"Authorization": f"Bearer {SCRAPE}"})
    assert status == 200 and b"epdserve" in text


def test_one_call_cannot_carry_forty_prompts(keyed_front):
    status, got = completion(keyed_front, {"prompt": [f"prompt {i}" for i in range(40)], "max_tokens": 1}, KEY)
    assert status == 400 and got["error"]["param"] == "prompt" and "at most 16" in got["error"]["message"], got


def test_stop_strings_count_in_the_prompt_budget(keyed_front):
    status, got = completion(keyed_front, {"prompt": "hi", "max_tokens": 1, "stop": ["x" * 3000, "y" * 3000]}, KEY)
    assert status == 400 and "stop strings" in got["error"]["message"], got


def test_a_keys_file_without_a_scrape_token_refuses_to_open_metrics(tmp_path):
    """With tenants, /metrics (every tenant's counts) needs a credential no tenant holds: without a
    scrape token or a single key the scheduler refuses to start, saying so (unless --metrics-auth off)."""
    keys = tmp_path / "keys"
    keys.write_text("alice sk-a\n")
    fronts = Fronts(HttpOptions(), security=SchedulerSecurity(api_keys_file=str(keys)), metrics_auth="auto")
    with pytest.raises(ValueError, match="scrape token"):
        fronts.check_exposure()
    assert Fronts(HttpOptions(), security=SchedulerSecurity(api_keys_file=str(keys)),
                  metrics_auth="off")._metrics_key("127.0.0.1") is None


def test_a_large_body_is_parsed_and_checked_as_a_small_one(keyed_front):
    """Over PARSE_OFF_LOOP_BYTES the body is parsed in a worker thread: the same answers follow."""
    from epdserve.entrypoints.http.options import PARSE_OFF_LOOP_BYTES

    status, got = completion(keyed_front, {"prompt": "x" * (PARSE_OFF_LOOP_BYTES + 1), "max_tokens": 1}, KEY)
    assert status == 400 and "prompt text" in got["error"]["message"], got
    status, got = call(keyed_front, "POST", "/v1/completions", b'{"prompt": ' + b" " * PARSE_OFF_LOOP_BYTES + b"}",
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert status == 400 and got["error"]["type"] == "BadRequestError"
