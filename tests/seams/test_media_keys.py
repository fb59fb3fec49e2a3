"""Media keys and namespaces: a key is keyed by the deployment's secret (same secret, same key;
another secret, another key; the secret never prints); same model + processor -> same namespace;
any change -> another."""
import os
import stat

import pytest
import torch
import xxhash

from epdserve.seams.media_keys import MEDIA_KEY_SECRET_ENV, MediaKeySecret, media_key, namespace_for

SECRET = MediaKeySecret("test-media-key-secret")

CONFIG = {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "image_mean": [0.48, 0.45, 0.40]}


def _tower(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)


def test_media_key_is_namespaced_and_keyed():
    key = media_key(b"\x89PNG...", "qwen@abc", SECRET)
    ns, digest = key.split(":")
    assert ns == "qwen@abc" and len(digest) == 32
    assert media_key(b"\x89PNG...", "qwen@abc", MediaKeySecret("test-media-key-secret")) == key
    assert media_key(b"\x89PNG..!", "qwen@abc", SECRET) != key
    assert media_key(b"\x89PNG...", "other@abc", SECRET) != key
    assert media_key(b"\x89PNG...", "qwen@abc", MediaKeySecret("another")) != key  # no secret, no key
    assert digest != xxhash.xxh3_128_hexdigest(b"\x89PNG...")  # not the forgeable hash of before


def test_media_key_refuses_bad_input():
    with pytest.raises(TypeError, match="raw media bytes"):
        media_key("not bytes", "ns", SECRET)
    with pytest.raises(ValueError, match="namespace"):
        media_key(b"x", "a:b", SECRET)
    with pytest.raises(TypeError, match="MediaKeySecret"):
        media_key(b"x", "ns", "a plain string")
    with pytest.raises(ValueError, match="empty"):
        MediaKeySecret("  ")


def test_secret_loads_from_a_file_or_the_environment_and_never_prints(tmp_path, monkeypatch):
    monkeypatch.delenv(MEDIA_KEY_SECRET_ENV, raising=False)
    assert MediaKeySecret.load() is None
    f = tmp_path / "media_key.secret"
    f.write_text("from-a-file\n")
    os.chmod(f, stat.S_IRUSR | stat.S_IWUSR)
    assert MediaKeySecret.load(file=f) == MediaKeySecret("from-a-file")
    monkeypatch.setenv(MEDIA_KEY_SECRET_ENV, "from-the-env")
    assert MediaKeySecret.load() == MediaKeySecret("from-the-env") == MediaKeySecret.of_process()
    assert MediaKeySecret.load(file=f) == MediaKeySecret("from-a-file")  # a file wins
    assert "from-the-env" not in repr(MediaKeySecret.load()) + str(MediaKeySecret.load())
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty media-key secret file"):
        MediaKeySecret.load(file=tmp_path / "empty")


def test_without_a_configured_secret_a_process_keys_with_one_random_secret(monkeypatch):
    monkeypatch.delenv(MEDIA_KEY_SECRET_ENV, raising=False)
    mine = MediaKeySecret.of_process()
    assert mine == MediaKeySecret.of_process()  # every engine of the process agrees
    assert mine != MediaKeySecret.random() and MediaKeySecret.random() != MediaKeySecret.random()


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
