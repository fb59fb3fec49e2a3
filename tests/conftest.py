"""Shared pytest fixtures: tiny random-weight demo checkpoints, built once per test session (once
per pytest-xdist worker); how many workers `-n auto` (pytest.ini) starts; and bytecode kept.

Bytecode is written during the suite even where the environment sets PYTHONDONTWRITEBYTECODE (this
machine does): without it every xdist worker re-rewrites every test module's asserts (~18 s of
collection each, measured with cProfile) and every launched process compiles epdserve from source
(~0.3 s each, several hundred processes). The caches land in the checkout's ignored __pycache__/.

The suite's dtype is fp32, the exactness oracle's, by one explicit test-wide default:
$EPDSERVE_DTYPE, read by every engine, instance and launch this process and its children start
that is not given `--dtype` (`--dtype auto` is bf16 on a CPU with AVX512-BF16, as this one has)."""
import os
import sys

import pytest

from epdserve.model.demo import build_demo_model

sys.dont_write_bytecode = False  # this process (pytest's assert-rewrite cache) ...
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # ... and the workers and processes it starts
os.environ["EPDSERVE_DTYPE"] = "float32"  # the exactness oracle's dtype, for everything the suite starts


def pytest_xdist_auto_num_workers(config):
    """One worker per core this process may use, at most 4: every worker launches deployments of
    several processes (~0.4 GB each), so more workers add memory and contention, not speed."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(scope="session")
def qwen2_vl_tiny(tmp_path_factory):
    """Path of a tiny Qwen2-VL demo checkpoint (seed 0)."""
    return build_demo_model(tmp_path_factory.mktemp("qwen2_vl_tiny"), arch="qwen2_vl", size="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen2_5_vl_tiny(tmp_path_factory):
    """Path of a tiny Qwen2.5-VL demo checkpoint (seed 0)."""
    return build_demo_model(tmp_path_factory.mktemp("qwen2_5_vl_tiny"), arch="qwen2_5_vl", size="tiny", seed=0)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def tiny_model_dir(request):
    """Each tiny demo checkpoint in turn (parametrized over both archs)."""
    return request.getfixturevalue(f"{request.param}_tiny")


@pytest.fixture(scope="session")
def qwen3_vl_tiny(tmp_path_factory):
    """Path of a tiny Qwen3-VL demo checkpoint (seed 0; DeepStack into LM layers 0 and 1)."""
    return build_demo_model(tmp_path_factory.mktemp("qwen3_vl_tiny"), arch="qwen3_vl", size="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_vl_moe_tiny(tmp_path_factory):
    """Path of a tiny Qwen3-VL-MoE demo checkpoint (seed 0; every LM layer a MoE layer)."""
    return build_demo_model(tmp_path_factory.mktemp("qwen3_vl_moe_tiny"), arch="qwen3_vl_moe", size="tiny", seed=0)
