"""Settings dataclasses make the flags (epdserve/settings.py): defaults, units and forwarding
agree with the dataclasses, so a setting is declared once."""
import argparse
import dataclasses

from epdserve.engine.config import EngineConfig
from epdserve.entrypoints.launch_settings import FORWARDED, LaunchSettings, add_launch_flags, instance_argv, \
    merged_options
from epdserve.instance.config import InstanceConfig, add_instance_args, from_args
from epdserve.settings import settings_of, shared_values


def _instance(argv):
    p = argparse.ArgumentParser()
    add_instance_args(p)
    return from_args(p.parse_args(["--roles", "PD", "--model", "/m", *argv]))


def test_no_flags_give_the_dataclass_defaults():
    assert _instance([]) == InstanceConfig(roles="PD", model="/m")


def test_flags_in_their_units_reach_the_fields():
    cfg = _instance(["--kv-cache-mb", "64", "--feature-cache-mb", "8", "--no-core-split", "--cores", "0-1",
                     "--block-size", "32"])
    assert cfg.kv_cache_bytes == 64 << 20 and cfg.feature_cache_bytes == 8 << 20
    assert cfg.split_cores is False and cfg.cores == [0, 1] and cfg.block_size == 32


def test_the_instance_hands_the_engine_its_own_settings():
    cfg = _instance(["--max-num-seqs", "7", "--feature-wait-s", "1.5", "--dtype", "float32"])
    engine = EngineConfig(**shared_values(cfg, EngineConfig), roles="PD")
    assert (engine.max_num_seqs, engine.feature_wait_s, engine.dtype) == (7, 1.5, "float32")
    assert engine.kv_cache_bytes == cfg.kv_cache_bytes and engine.model == "/m"
    shared = {f.name for f in dataclasses.fields(InstanceConfig)
              if f.metadata.get("epdserve_same_as", (None,))[0] is EngineConfig}
    assert len(shared_values(cfg, EngineConfig)) == len(shared) >= 8


def test_an_engine_or_kv_transfer_setting_has_one_help_text():
    inst = {f.name: (f, s) for f, s in settings_of(InstanceConfig)}
    for name, (f, s) in inst.items():
        owner = f.metadata.get("epdserve_same_as")
        if owner:
            assert s is dict((g.name, t) for g, t in settings_of(owner[0]))[owner[1]], name


def test_launch_forwards_what_was_given_by_field():
    p = argparse.ArgumentParser()
    add_launch_flags(p)
    args = p.parse_args(["--mode", "P-D", "--kv-cache-mb", "32", "--colocation", "yield"])
    merged = merged_options(args, {"max_num_seqs": 4})
    assert instance_argv(merged) == ["--kv-cache-mb", "32", "--max-num-seqs", "4", "--colocation", "yield"]
    assert merged["port"] == LaunchSettings().port and merged["drain_timeout"] == 10.0
    # every forwarded flag is one `epdserve instance` takes, and it reads back into the same field
    argv = instance_argv({**merged, "block_size": 64, "max_model_len": 99, "feature_wait_s": 2.0,
                          "encode_token_budget": 5, "stream_interval_ms": 1.0, "slo_tpot_ms": 80.0,
                          "no_step_budget": True, "step_budget_bank": 6.0, "step_budget_horizon": 4, "no_prefix_caching": True, "kv_hop": "host",
                          "enforce_eager": True, "no_pipelined_prefill": True,
                          "encode_per_item": True, "tensor_parallel_size": 2, "scheduling_policy": "fcfs"})
    cfg = _instance(argv)
    assert (cfg.tensor_parallel_size, cfg.scheduling_policy) == (2, "fcfs")
    assert (cfg.kv_cache_bytes, cfg.block_size, cfg.max_model_len, cfg.slo_tpot_ms) == (32 << 20, 64, 99, 80.0)
    assert cfg.kv_hop == "host"
    assert cfg.step_budget is False and "--no-step-budget" in argv and cfg.step_budget_bank == 6.0
    assert cfg.step_budget_horizon == 4
    assert cfg.enable_prefix_caching is False and cfg.enforce_eager is True
    assert cfg.pipelined_prefill is False and "--no-pipelined-prefill" in argv and cfg.encode_per_item is True
    # flags without a value: --no-step-budget, --no-prefix-caching, --enforce-eager, --no-pipelined-prefill,
    # --encode-per-item
    assert len(argv) == 2 * len(FORWARDED) - 5


def test_launch_slo_reaches_the_engines_the_controller_and_the_planner():
    """One --slo-tpot-ms: every instance's step budget, the scheduler's role controller and the
    `--mode auto` planner count against it (and --slo-ttft-ms the controller and the planner)."""
    from epdserve.entrypoints.cli import build_parser
    from epdserve.entrypoints.launch import spec_from_args
    from epdserve.entrypoints.launch_settings import slo_of
    from epdserve.entrypoints.scheduler_cli import config_from_args
    from epdserve.slo import SLO

    argv = ["launch", "--mode", "P-D", "--model", "demo-dir", "--slo-tpot-ms", "80", "--slo-ttft-ms", "1500",
            "--routing", "least-load"]
    args = build_parser(argv).parse_args(argv)
    spec = spec_from_args(args)
    assert _instance([a for a in spec.instance_args if a != "--insecure"][:2]).slo_tpot_ms == 80.0
    sched = ["scheduler", "--model", "demo-dir", "--controller", *spec.scheduler_args]
    cfg = config_from_args(build_parser(sched).parse_args(sched))
    assert (cfg.controller.slo_tpot_ms, cfg.controller.slo_ttft_ms, cfg.routing) == (80.0, 1500.0, "least-load")
    assert slo_of(merged_options(args, {})) == SLO(ttft_ms=1500.0, tpot_ms=80.0)
    # not given: the one default everywhere
    bare = build_parser(argv[:5]).parse_args(argv[:5])
    assert "--slo-tpot-ms" not in spec_from_args(bare).scheduler_args and slo_of(merged_options(bare, {})) == SLO()
    assert EngineConfig(model="/m").slo_tpot_ms == InstanceConfig(roles="PD", model="/m").slo_tpot_ms == SLO().tpot_ms


def test_validation_is_declared_on_the_field_and_carried_by_same_as():
    import pytest

    from epdserve.scheduler.controller import ControllerConfig
    from epdserve.slo import SLO

    for make in (lambda: SLO(tpot_ms=0), lambda: EngineConfig(model="/m", slo_tpot_ms=-1),
                 lambda: InstanceConfig(roles="PD", model="/m", slo_tpot_ms=0),
                 lambda: ControllerConfig(slo_tpot_ms=0)):
        with pytest.raises(ValueError, match="must be > 0"):
            make()
    with pytest.raises(ValueError, match="kv_cache_bytes must be >= 1"):
        InstanceConfig(roles="PD", model="/m", kv_cache_bytes=0)


def test_feature_wait_has_one_default_that_waits_for_e():
    """`feature_wait_s` is read only by an engine that prefills without encoding (a P whose E is
    another instance): its one default waits for E, in the engine and in every instance."""
    assert EngineConfig(model="/m").feature_wait_s == InstanceConfig(roles="P", model="/m").feature_wait_s > 0
    assert _instance([]).feature_wait_s == EngineConfig(model="/m").feature_wait_s


def test_the_instance_hands_its_kv_pairs_the_transfer_settings():
    """The `--kv-*` settings are `KVTransferConfig`'s, declared there once: every one is an
    instance flag, and what the flags say is what the instance's KV pairs get."""
    from epdserve.transfer.kv import KVTransferConfig

    offered = {f.metadata["epdserve_same_as"][1] for f in dataclasses.fields(InstanceConfig)
               if f.metadata.get("epdserve_same_as", (None,))[0] is KVTransferConfig}
    assert offered == {f.name for f, _ in settings_of(KVTransferConfig)}
    assert _instance([]).kv_transfer() == KVTransferConfig()
    kv = _instance(["--kv-timeout-s", "7", "--kv-connect-timeout-s", "9", "--kv-hop", "host", "--kv-pair-rebuilds",
                    "3", "--kv-pair-rebuild-window-s", "11"]).kv_transfer()
    assert (kv.timeout_s, kv.connect_timeout_s, kv.hop, kv.max_pair_rebuilds, kv.pair_rebuild_window_s) == \
        (7.0, 9.0, "host", 3, 11.0)
