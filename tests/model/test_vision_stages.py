"""`VisionRun` (model/vision_stages.py): a vision tower run a few blocks at a time gives the
same features, bit for bit, as the tower's own forward on the same batch — every supported family
(Qwen2-VL, Qwen2.5-VL with window attention, Qwen3-VL and its MoE with DeepStack)."""
import pytest
import torch

from epdserve.engine.loaded_model import load_model
from epdserve.model.demo_images import procedural_image
from epdserve.model.vision_stages import VisionRun, sliceable
from tests.harness import PH


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("step", [1, 2])
def test_blocks_in_slices_equal_the_forward(request, arch, step):
    model = load_model(str(request.getfixturevalue(f"{arch}_tiny")), "cpu")
    adapter = model.adapter
    assert sliceable(adapter.config.model_type)
    images = [procedural_image(96, 64, 1), procedural_image(64, 128, 2)]  # two items in one batch
    media = model.processor.process(PH + PH + "two", images, None, None).media
    pvs, grids = [m.pixel_values for m in media], [m.grid_thw for m in media]
    whole = adapter.encode_images(pvs, grids)
    run = VisionRun(adapter, pvs, grids)
    calls = 0
    while not run.done:
        assert run.run(step) == min(step, run.num_blocks - run.blocks_done + step) or run.done
        calls += 1
    assert calls == -(-run.num_blocks // step) and run.num_blocks >= 2
    sliced = run.finish()
    assert len(sliced) == len(whole) == 2
    for a, b in zip(sliced, whole):
        assert len(a) == len(b) == 1 + adapter.num_deepstack
        for x, y in zip(a, b):
            assert torch.equal(x, y)
