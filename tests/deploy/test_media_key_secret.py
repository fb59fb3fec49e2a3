"""The deployment's media-key secret (issue 35): `launch` makes one unless EPDSERVE_MEDIA_KEY_SECRET
is set, and hands it to the scheduler — the one process that keys media — in its environment,
never its argv; instances get none from it."""
from __future__ import annotations

import os
import stat

from epdserve.deploy.local.deployment import Deployment, DeploymentSpec
from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV


def _scheduler_env(dep: Deployment, tmp_path) -> tuple[dict, list[str]]:
    child = dep._scheduler_child(0, tmp_path / "scheduler.address")
    child.log_stream.close()
    return child.env, child.argv


def test_a_made_secret_goes_to_the_scheduler_only(tmp_path, monkeypatch):
    monkeypatch.delenv(MEDIA_KEY_SECRET_ENV, raising=False)
    dep = Deployment(DeploymentSpec(mode="E-P-D", model="unused", log_dir=str(tmp_path)))
    other = Deployment(DeploymentSpec(mode="E-P-D", model="unused", log_dir=str(tmp_path / "b")))
    assert len(dep.media_key_secret) >= 32 and dep.media_key_secret != other.media_key_secret
    env, argv = _scheduler_env(dep, tmp_path)
    assert env[MEDIA_KEY_SECRET_ENV] == dep.media_key_secret
    assert not any(dep.media_key_secret in a for a in argv)
    assert MEDIA_KEY_SECRET_ENV not in dep._env(0)  # instances take the scheduler's keys
    path = dep._write_secret("media_key.secret", dep.media_key_secret)  # as start() keeps a made one
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.read_text().strip() == dep.media_key_secret


def test_the_launchers_secret_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(MEDIA_KEY_SECRET_ENV, "the-operators-media-key-secret")
    dep = Deployment(DeploymentSpec(mode="monolithic", model="unused", log_dir=str(tmp_path)))
    assert _scheduler_env(dep, tmp_path)[0][MEDIA_KEY_SECRET_ENV] == "the-operators-media-key-secret"
