"""`epdserve launch --mode EP-D` with no --model, on a machine that has never run epdserve (an
empty XDG_CACHE_HOME): it builds the built-in random-weight demo checkpoint into the cache, serves
it, says so in its ready line with how to pass a real one, and a greedy request's tokens equal
transformers' `generate` on that checkpoint."""
from __future__ import annotations

import os
import re

import pytest

from epdserve.client import Client
from epdserve.model.reference import ReferenceGenerator
from tests.entrypoints.launch_harness import launched as launch_process
from tests.instance.harness import PH, image

pytestmark = pytest.mark.slow

READY = re.compile(r"^epdserve ready: grpc://(?P<grpc>\S+) mode=EP-D .* model=(?P<model>\S+) (?P<note>\(.*\))$")


def test_launch_without_model_serves_the_cached_demo_exactly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "EPDSERVE_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    with launch_process(["--mode", "EP-D", "--kv-cache-mb", "16"], env, READY) as (found, _):
        model = found["model"]
        assert model.startswith(str(tmp_path / "cache" / "epdserve" / "demo-models" / "qwen2_vl-tiny-"))
        assert "random weights" in found["note"] and "--model DIR" in found["note"]
        img = image(7, 84, 56)
        prompt = f"Describe {PH} briefly."
        with Client(found["grpc"], timeout=120) as c:
            out = c.generate(prompt, images=[img], max_tokens=8, temperature=0.0, ignore_eos=True)
    assert out.token_ids == ReferenceGenerator(model).generate(prompt, [img], max_tokens=8)
