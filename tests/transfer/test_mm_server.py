"""LocalRedisServer: a real private server on a free port, stopped on exit and with its parent."""
import os
import select
import subprocess
import sys
import textwrap

import pytest
import redis

from epdserve.transfer.mm_store.server import LocalRedisServer


def _pid_exits(pid: int, timeout_s: float) -> bool:
    """Wait for a (non-child) process to exit through a pidfd: an event, not a poll loop."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable)
    finally:
        os.close(fd)


def _server_pid(client: redis.Redis) -> int:
    return int(client.info("server")["process_id"])


def test_start_ping_config_and_stop():
    with LocalRedisServer(maxmemory="32mb", maxmemory_policy="allkeys-lru", password="s3cr:t/") as srv:
        client = redis.Redis.from_url(srv.url)
        assert client.ping()
        cfg = client.config_get("maxmemory*")
        assert cfg["maxmemory"] == str(32 * 1024 * 1024) and cfg["maxmemory-policy"] == "allkeys-lru"
        assert srv.url.startswith("redis://:s3cr%3At%2F@127.0.0.1:")
        pid = _server_pid(client)
        client.close()
    assert not srv.running
    assert _pid_exits(pid, timeout_s=10)


def test_restart_on_the_same_port():
    srv = LocalRedisServer().start()
    try:
        url = srv.url
        srv.stop()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        srv.start()
        assert srv.url == url and redis.Redis.from_url(url).ping()
    finally:
        srv.stop()


def test_server_dies_with_its_parent():
    script = textwrap.dedent(
        """
        import os, signal, sys, redis
        from epdserve.transfer.mm_store.server import LocalRedisServer
        srv = LocalRedisServer().start()
        print(redis.Redis.from_url(srv.url).info("server")["process_id"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no __exit__: only PDEATHSIG is left
        """
    )
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux only")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    server_pid = int(proc.stdout.strip())
    assert _pid_exits(server_pid, timeout_s=10)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="maxmemory policy"):
        LocalRedisServer(maxmemory_policy="lru")
    with pytest.raises(ValueError, match="port"):
        LocalRedisServer(port=70000)
    with pytest.raises(RuntimeError, match="start"):
        LocalRedisServer().url


def test_missing_binary_is_a_clear_error(tmp_path):
    from epdserve.transfer.mm_store.server import ServerStartError

    with pytest.raises(ServerStartError, match="cannot run"):
        LocalRedisServer(binary=str(tmp_path / "no-such-server")).start()


def test_server_that_exits_or_never_answers_is_a_clear_error(tmp_path, monkeypatch):
    from epdserve.net import free_port
    from epdserve.transfer.mm_store.server import ServerStartError

    script = tmp_path / "fake-server"
    script.write_text("#!/bin/sh\n[ -n \"$EPD_FAKE_EXIT\" ] && exit 3\nexec sleep 30\n")
    script.chmod(0o755)
    with pytest.raises(ServerStartError, match="did not answer PING"):
        LocalRedisServer(binary=str(script), startup_timeout_s=0.3).start()  # tries three ports
    monkeypatch.setenv("EPD_FAKE_EXIT", "1")
    with pytest.raises(ServerStartError, match="exited with code 3"):
        LocalRedisServer(binary=str(script), port=free_port(), startup_timeout_s=10).start()
