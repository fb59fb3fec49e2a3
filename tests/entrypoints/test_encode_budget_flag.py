"""`--encode-token-budget`: from `epdserve launch` (flag or YAML) to every instance, to its engines."""
from __future__ import annotations

import argparse

import pytest

from epdserve.entrypoints.cli import build_parser
from epdserve.entrypoints.launch import spec_from_args
from epdserve.instance.config import add_instance_args, from_args


def _instance(*argv):
    p = argparse.ArgumentParser()
    add_instance_args(p)
    return from_args(p.parse_args(["--roles", "E", "--model", "/m", *argv]))


def test_launch_passes_the_budget_to_instances(tmp_path):
    s = spec_from_args(build_parser().parse_args(["launch", "--mode", "E-P-D", "--model", "/m",
                                                  "--encode-token-budget", "512"]))
    assert s.instance_args == ["--encode-token-budget", "512"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: E-P-D\nmodel: /m\nencode_token_budget: 256\n")
    s = spec_from_args(build_parser().parse_args(["launch", "--config", str(cfg)]))
    assert s.instance_args == ["--encode-token-budget", "256"]


def test_launch_passes_the_colocation_policy_and_stream_interval(tmp_path):
    s = spec_from_args(build_parser().parse_args(["launch", "--mode", "EP-D", "--model", "/m", "--colocation", "yield",
                                                  "--stream-interval-ms", "20"]))
    assert s.instance_args == ["--colocation", "yield", "--stream-interval-ms", "20.0"]
    inst = _instance(*s.instance_args)
    assert (inst.colocation, inst.stream_interval_ms) == ("yield", 20.0)


def test_instance_flag_default_and_validation():
    assert _instance().encode_token_budget == 1024
    assert _instance("--encode-token-budget", "64").encode_token_budget == 64
    with pytest.raises(ValueError, match="encode_token_budget"):
        _instance("--encode-token-budget", "0")
