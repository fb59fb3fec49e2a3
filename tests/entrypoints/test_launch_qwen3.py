"""Qwen3-VL served by `epdserve launch` (real processes, CPU, tiny demo models): greedy outputs
equal transformers' generate. Qwen3-VL in every mode, Qwen3-VL-MoE monolithic and E-P-D.

Instances prefill in chunks of at most 16 tokens, so images are cut by chunk boundaries and the
DeepStack features of a cut image are added on both sides of the cut; in E-P-D the features
(main + DeepStack, one MM Store value) reach P from E: P runs no vision encoder. Videos are
served in every deployment too, equal to the golden tokens transformers made from its own video
pipeline (tests/model/fixtures/video).

Qwen3-VL E-P-D also runs with `--encode-token-budget 4` (below one temporal patch): every instance
gets the flag, E encodes each video a temporal patch per step and stores its features (with
DeepStack) whole, each video and image exactly once, and P uses them; outputs still equal the
golden tokens. (Qwen3-VL-MoE E-P-D and Qwen3-VL E-PD keep the default budget.)
"""
from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest

from epdserve.client import Client, EPDServeError
from epdserve.model.demo_images import procedural_image
from epdserve.model.reference import ReferenceGenerator
from tests.entrypoints.test_launch import TOKEN, _kill, _launch
from tests.instance.harness import PH, image, status, stub

pytestmark = pytest.mark.slow

DEPLOYMENTS = [("qwen3_vl", m) for m in ("monolithic", "E-P-D", "EP-D", "ED-P", "E-PD")] + \
              [("qwen3_vl_moe", m) for m in ("monolithic", "E-P-D")]
CHUNK = 16
MAX_TOKENS = 8
VIDEO_FIXTURES = Path(__file__).parents[1] / "model" / "fixtures" / "video"
ENCODE_BUDGET = {("qwen3_vl", "E-P-D"): "4"}  # a budget below one temporal patch: videos are encoded in slices


def workload() -> list[tuple[str, list[bytes]]]:
    """6 prompts with 0, 1, 2, 3, 1, 2 images of odd sizes."""
    out = []
    for i, k in enumerate((0, 1, 2, 3, 1, 2)):
        text = f"Request {i}: " + " and ".join(PH for _ in range(k)) + (" describe." if k else " say hi.")
        out.append((text, [image(300 + 10 * i + j, 61 + 47 * ((i + j) % 4), 75 + 39 * (j % 3)) for j in range(k)]))
    return out


@pytest.fixture(scope="module")
def references(request):
    refs = {}
    for arch in ("qwen3_vl", "qwen3_vl_moe"):
        gen = ReferenceGenerator(request.getfixturevalue(f"{arch}_tiny"))
        refs[arch] = [gen.generate(p, imgs, max_tokens=MAX_TOKENS) for p, imgs in workload()]
        longest = max(len(gen.processor.process(p, imgs).token_ids) for p, imgs in workload())
        assert longest > 3 * CHUNK  # prompts are prefilled in several chunks
    return refs


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=lambda p: "-".join(p))
def deployment(request):
    arch, mode = request.param
    budget = ("--encode-token-budget", ENCODE_BUDGET[arch, mode]) if (arch, mode) in ENCODE_BUDGET else ()
    dep = _launch(mode, request.getfixturevalue(f"{arch}_tiny"),
                  ("--instance-args", f"--max-num-batched-tokens {CHUNK}", *budget))
    family = [psutil.Process(dep.proc.pid), *psutil.Process(dep.proc.pid).children(recursive=True)]
    try:
        yield arch, dep
        dep.proc.send_signal(signal.SIGTERM)
        assert dep.proc.wait(120) == 0, "".join(dep.output[-40:])
        left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left behind: {[p.cmdline()[:6] for p in left]}"
    finally:
        if dep.proc.poll() is None:
            _kill(dep.proc)


def test_concurrent_requests_match_transformers(deployment, references):
    arch, dep = deployment
    with Client(dep.address, timeout=300) as c, ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda w: c.generate(w[0], images=w[1], max_tokens=MAX_TOKENS, ignore_eos=True),
                                workload()))
    for (prompt, images), r, want in zip(workload(), results, references[arch]):
        assert r.token_ids == want, prompt
        assert (r.usage.vision_tokens > 0) == bool(images)
    if dep.mode == "E-P-D":  # features and DeepStack came through the MM Store, not a recompute on P
        encoded = _encoded_by_role(dep)
        assert encoded["E"] >= sum(len(imgs) for _, imgs in workload()) and encoded["P"] == 0


def _encoded_by_role(dep) -> dict[str, int]:
    return {i.roles: status(stub(i.address, TOKEN)).load.images_encoded for i in dep.instances()
            if i.roles in ("E", "P")}


def test_videos_match_transformers_golden_tokens(deployment):
    arch, dep = deployment
    cases = [rec for p in sorted(VIDEO_FIXTURES.glob("*.json")) if (rec := json.loads(p.read_text()))["arch"] == arch]
    assert cases

    def run(rec):
        # PNG keeps the image's pixels exact (the fixtures saw the PIL image itself)
        images = [procedural_image(w, h, s) for (w, h), s in zip(rec["image_sizes"], rec["image_seeds"])]
        return c.generate(rec["prompt"], images=images, videos=[(VIDEO_FIXTURES / rec["video_file"]).read_bytes()],
                          video_options={"fps": rec["fps"]}, max_tokens=rec["max_new_tokens"], ignore_eos=True)

    budget = ENCODE_BUDGET.get((arch, dep.mode))
    if budget:  # every instance got the flag; E's count before this test's media (all new to the deployment)
        argvs = [p.cmdline() for p in psutil.Process(dep.proc.pid).children(recursive=True)]
        instances_argv = [a for a in argvs if "instance" in a]
        assert len(instances_argv) >= 3  # E, P and D instances
        assert all(a[a.index("--encode-token-budget") + 1] == budget for a in instances_argv)
        encoded_before = _encoded_by_role(dep)["E"]
    with Client(dep.address, timeout=300) as c, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, cases))
        bad = pool.submit(c.generate, "bad <|vision_start|><|video_pad|><|vision_end|>", videos=[b"\x00" * 64],
                          max_tokens=2)
        with pytest.raises(EPDServeError) as e:
            bad.result()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "video" in str(e.value)
    for rec, r in zip(cases, results):
        assert r.token_ids == rec["greedy_tokens"], rec["video_file"]
        assert r.usage.prompt_tokens == len(rec["input_ids"])
    if dep.mode == "E-P-D":  # the videos' features came from E through the MM Store
        encoded = _encoded_by_role(dep)
        assert encoded["P"] == 0
        if budget:  # sliced, yet each video and image encoded once, by E
            assert encoded["E"] - encoded_before == sum(1 + len(rec["image_sizes"]) for rec in cases)
