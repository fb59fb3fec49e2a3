"""doctor's torch_npu fix names the exact pin setup.py's NPU extras carry (read from the installed
metadata), never a `X.*` wildcard that pip resolves to a .post build for another CANN."""

from packaging.specifiers import SpecifierSet

from epdserve.checks.npu.pins import extra_pins, npu_fix


def test_the_extras_pins_are_read_from_the_installed_metadata():
    pins = extra_pins()
    assert pins["npu-cann85"] == {"torch": "2.9.0", "torch-npu": "2.9.0"}
    assert pins["npu-cann83"] == {"torch": "2.8.0", "torch-npu": "2.8.0"}
    assert pins["npu"]["torch-npu"] == pins["npu"]["torch"]


def test_the_fix_is_the_exact_pin_which_no_post_build_matches():
    fix = npu_fix("2.9.0")
    assert "pip install 'torch-npu==2.9.0'" in fix and "[npu-cann85]" in fix
    assert "2.9.0.post2" not in SpecifierSet("==2.9.0")  # Ascend/pytorch COMPATIBILITY.en.md: CANN 9.0.0's build
    assert "2.9.0.post2" in SpecifierSet("==2.9.0.*")  # what the old fix let pip pick


def test_a_torch_no_extra_pairs_names_the_extras():
    fix = npu_fix("2.5.1")
    assert "epdserve[EXTRA]" in fix and "[npu-cann83] torch 2.8.0" in fix and ".*" not in fix


def test_without_the_package_metadata_the_pin_is_still_exact():
    assert npu_fix("2.9.0", dist="no-such-dist").startswith("pip install 'torch-npu==2.9.0' (exactly")
