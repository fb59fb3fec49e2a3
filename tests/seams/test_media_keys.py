"""Media keys and namespaces: same model + processor -> same namespace; any change -> another."""
import pytest
import torch

from epdserve.seams.media_keys import media_key, namespace_for

CONFIG = {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "image_mean": [0.48, 0.45, 0.40]}


def _tower(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)


def test_media_key_is_namespaced_xxh3_128():
    key = media_key(b"\x89PNG...", "qwen@abc")
    ns, digest = key.split(":")
    assert ns == "qwen@abc" and len(digest) == 32
    assert media_key(b"\x89PNG...", "qwen@abc") == key
    assert media_key(b"\x89PNG..!", "qwen@abc") != key
    assert media_key(b"\x89PNG...", "other@abc") != key


def test_media_key_refuses_bad_input():
    with pytest.raises(TypeError, match="raw media bytes"):
        media_key("not bytes", "ns")
    with pytest.raises(ValueError, match="namespace"):
        media_key(b"x", "a:b")


def test_namespace_is_stable_for_the_same_model():
    a = namespace_for("Qwen/Qwen2-VL-2B-Instruct", _tower(0), dict(CONFIG))
    b = namespace_for("Qwen/Qwen2-VL-2B-Instruct", _tower(0), dict(reversed(list(CONFIG.items()))))
    assert a == b and a.startswith("Qwen2-VL-2B-Instruct@")


def test_namespace_changes_with_model_weights_dtype_and_processor():
    base = namespace_for("m", _tower(0), CONFIG)
    changed_weight = _tower(0)
    with torch.no_grad():
        changed_weight[0].weight[0, 0] += 1.0  # index 0 is always in the strided sample
    variants = {
        "model id": namespace_for("m2", _tower(0), CONFIG),
        "weights": namespace_for("m", _tower(1), CONFIG),
        "one weight": namespace_for("m", changed_weight, CONFIG),
        "dtype": namespace_for("m", _tower(0, torch.bfloat16), CONFIG),
        "processor": namespace_for("m", _tower(0), {**CONFIG, "min_pixels": 6272}),
        "architecture": namespace_for("m", torch.nn.Linear(8, 16), CONFIG),
    }
    for what, ns in variants.items():
        assert ns != base, what
    assert len(set(variants.values())) == len(variants)


def test_namespace_refuses_bad_input():
    with pytest.raises(ValueError, match="model_id"):
        namespace_for("", _tower(), CONFIG)
    with pytest.raises(TypeError, match="to_dict"):
        namespace_for("m", _tower(), "patch_size=14")
