"""`epdserve launch --encode-token-budget` through real processes: E-P-D with Qwen3-VL (tiny) and a
budget below one temporal patch, so E encodes each video a temporal patch per step, stores its
features (with DeepStack) whole in the MM Store, and P uses them. Greedy outputs equal the golden
tokens transformers made from its own video pipeline (tests/model/fixtures/video), a small image
request sent alongside equals transformers' generate."""
from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from epdserve.entrypoints.client import Client
from epdserve.model.demo_images import procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.entrypoints.test_launch import _kill, _launch
from tests.instance.harness import PH, image, status, stub

pytestmark = pytest.mark.slow
FIXTURES = Path(__file__).parents[1] / "model" / "fixtures" / "video"


def test_e_p_d_encodes_videos_in_slices_and_matches_golden_tokens(qwen3_vl_tiny):
    cases = [r for p in sorted(FIXTURES.glob("*.json")) if (r := json.loads(p.read_text()))["arch"] == "qwen3_vl"]
    small = image(5, 64, 64)
    want_small = ReferenceGenerator(qwen3_vl_tiny).generate(f"Look: {PH}", [small], max_tokens=6)
    dep = _launch("E-P-D", qwen3_vl_tiny, ("--encode-token-budget", "4"))
    try:
        argvs = [p.cmdline() for p in psutil.Process(dep.proc.pid).children(recursive=True)]
        instances_argv = [a for a in argvs if "instance" in a]
        assert len(instances_argv) >= 3  # E, P and D instances: each got the budget
        assert all(a[a.index("--encode-token-budget") + 1] == "4" for a in instances_argv)

        def run(rec):
            images = [procedural_image(w, h, s) for (w, h), s in zip(rec["image_sizes"], rec["image_seeds"])]
            return c.generate(rec["prompt"], images=images, videos=[(FIXTURES / rec["video_file"]).read_bytes()],
                              video_options={"fps": rec["fps"]}, max_tokens=rec["max_new_tokens"], ignore_eos=True)

        with Client(dep.address, timeout=300) as c, ThreadPoolExecutor(4) as pool:
            videos = [pool.submit(run, rec) for rec in cases]
            tiny = pool.submit(c.generate, f"Look: {PH}", images=[small], max_tokens=6, ignore_eos=True)
            results = [f.result() for f in videos]
            assert tiny.result().token_ids == want_small
            instances = list(c.server_info().instances)
        for rec, r in zip(cases, results):
            assert r.token_ids == rec["greedy_tokens"], rec["video_file"]
        encoded = {i.roles: status(stub(i.address)).load.images_encoded for i in instances if i.roles in ("E", "P")}
        assert encoded["P"] == 0 and encoded["E"] == sum(1 + len(r["image_sizes"]) for r in cases) + 1
        dep.proc.send_signal(signal.SIGTERM)
        assert dep.proc.wait(120) == 0, "".join(dep.output[-40:])
    finally:
        if dep.proc.poll() is None:
            _kill(dep.proc)
