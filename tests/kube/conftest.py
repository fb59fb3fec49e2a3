"""Every mode x flavour rendered once per test session (tests/kube/)."""
from __future__ import annotations

import itertools

import pytest

from epdserve.instance.modes import MODES
from epdserve.deploy.kube.flavours import FLAVOURS
from epdserve.deploy.kube.render import render
from epdserve.deploy.kube.values import KubeValues

CASES = list(itertools.product(MODES, FLAVOURS))


def values_for(mode: str, flavour: str) -> KubeValues:
    """Two of each role where the mode sizes it, so the beyond-pools (EP-D's E-only) are rendered too."""
    return KubeValues(mode=mode, flavour=flavour, encode=2, prefill=1, decode=1, secrets="generate")


@pytest.fixture(scope="session")
def rendered() -> dict[tuple[str, str], list[dict]]:
    return {(m, f): render(values_for(m, f)) for m, f in CASES}
