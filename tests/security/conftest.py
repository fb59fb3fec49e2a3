"""Fixtures the security tests share."""
import pytest


@pytest.fixture
def no_env_secrets(monkeypatch):
    """No API key, cluster token or scrape token from the environment of whoever runs the tests:
    each test names the credentials its deployment has."""
    for name in ("EPDSERVE_API_KEY", "EPDSERVE_CLUSTER_TOKEN", "EPDSERVE_METRICS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
