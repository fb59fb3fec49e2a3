"""A deployment under the `slo` co-location policy (instance/colocation.py) on CPU: the launcher's
core-lease arbiter serves every instance, each stage takes the cores for its steps (encode, prefill
and decode all granted), and greedy outputs still equal transformers' token for token — with
concurrent mixed traffic, so encode and prefill are asked to yield to decode mid-step."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from epdserve.client import Client
from epdserve.deploy.deployment import Deployment, DeploymentSpec
from epdserve.model.reference import ReferenceGenerator
from tests.entrypoints.test_launch import workload

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def _workload():
    return workload()[:8]  # the launch tests' mixed prompts (1-3 images, some text-only)


@pytest.fixture(scope="module")
def refs(qwen2_vl_tiny):
    """transformers' greedy outputs of the workload (the same for both modes)."""
    gen = ReferenceGenerator(qwen2_vl_tiny)
    return [gen.generate(p, imgs, max_tokens=MAX_TOKENS) for p, imgs in _workload()]


@pytest.mark.parametrize("mode", ["E-P-D", "EP-D"])
def test_outputs_under_the_core_lease_match_transformers(mode, qwen2_vl_tiny, refs):
    work = _workload()
    dep = Deployment(DeploymentSpec(mode=mode, model=str(qwen2_vl_tiny),
                                    instance_args=["--colocation", "slo", "--slo-tpot-ms", "20", "--kv-cache-mb", "16",
                                                   "--feature-wait-s", "20"]))
    try:
        addr = dep.start()
        assert dep._arbiter is not None
        with Client(addr, timeout=300) as c, ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda w: c.generate(w[0], images=w[1], max_tokens=MAX_TOKENS, ignore_eos=True), work))
        assert [list(o.token_ids) for o in outs] == refs
        grants = dep._arbiter.grants
        assert grants[b"E"] > 0 and grants[b"P"] > 0 and grants[b"D"] >= MAX_TOKENS - 1, grants
    finally:
        dep.stop()
