"""MM Store passwords never in a child's argv nor the ready line (issue 39): `launch --mm-store
redis://:pass@...` hands instances the URL without its passwords and the passwords in their
environment; the sentinels' password may come from the environment too (it had only the URL's
``?sentinel_password=``). On today's main the children's argv and the ready line carry them."""
from __future__ import annotations

import shutil

import pytest

from epdserve.deploy.local.deployment import Deployment, DeploymentSpec
from epdserve.entrypoints.launch import ready_line
from epdserve.transfer.mm_store.connection import PASSWORD_ENV
from epdserve.transfer.mm_store.topology import make_client
from epdserve.transfer.mm_store.urls import SENTINEL_PASSWORD_ENV, parse

URL = "redis+sentinel://epd:n0de-pa55@127.0.0.1:26379/epdmaster?sentinel_password=s3ntinel-pa55&socket_timeout=2"


@pytest.fixture
def dep(tmp_path):
    d = Deployment(DeploymentSpec(mode="P-D", model="/m", mm_store=URL, log_dir=str(tmp_path / "logs")))
    yield d
    shutil.rmtree(d.log_dir, ignore_errors=True)


def test_the_store_passwords_leave_argv_and_the_ready_line(dep):
    shown = " ".join([*dep._instance_argv("PD"), ready_line(dep, "127.0.0.1:1", None)])
    assert "n0de-pa55" not in shown and "s3ntinel-pa55" not in shown
    assert "redis+sentinel://epd@127.0.0.1:26379/epdmaster?socket_timeout=2" in shown  # the rest of the URL stays
    env = dep._env(0)
    assert env[PASSWORD_ENV] == "n0de-pa55" and env[SENTINEL_PASSWORD_ENV] == "s3ntinel-pa55"


def test_the_sentinel_password_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(SENTINEL_PASSWORD_ENV, "from-env")
    client = make_client(parse("redis+sentinel://127.0.0.1:26379/epdmaster"), socket_timeout_s=1,
                         connect_timeout_s=1, auth={}, extra={})
    sentinel = client.connection_pool.connection_kwargs.get("password"), \
        client.connection_pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"]
    assert sentinel == (None, "from-env")  # the sentinels', not the data nodes'
