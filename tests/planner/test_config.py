"""The chosen deployment as a launch config, read back by `epdserve launch`'s own loader."""
import pytest

from epdserve.entrypoints.cli import build_parser, main
from epdserve.entrypoints.launch import load_config, spec_from_args
from epdserve.instance.modes import MODES
from epdserve.planner.deployment import PlannedDeployment, from_pools, parse_summary, splits

from .conftest import PROFILE, SERVE


def _launch_spec(path, model="/tmp/some-model"):
    args = build_parser().parse_args(["launch", "--config", str(path), "--model", model])
    return spec_from_args(args)


@pytest.mark.parametrize("mode", MODES)
def test_every_split_round_trips_through_launch(tmp_path, mode):
    import yaml

    for dep in splits(mode, 4):
        path = tmp_path / f"{mode}-{dep.encode}{dep.prefill}{dep.decode}.yaml"
        path.write_text(yaml.safe_dump(dep.launch_config("cpu")))
        spec = _launch_spec(path)
        back = PlannedDeployment(spec.mode, spec.encode, spec.prefill, spec.decode)
        assert back.pools == dep.pools
        assert from_pools(mode, parse_summary(dep.summary)).pools == dep.pools


def test_plan_out_writes_a_config_launch_accepts(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    rc = main(["plan", "--profile", str(PROFILE), "--trace", str(SERVE), "--devices", "2", "--colocated-host",
               "--out", str(out), "--json", str(tmp_path / "plan.json")])
    text = capsys.readouterr().out
    assert rc == 0
    best = text.split("best: ")[1].split()[0]
    cfg = load_config(out)
    assert cfg["mode"] == best and cfg["device"] == "cpu"
    spec = _launch_spec(out)
    assert spec.mode == best
    assert out.read_text().startswith("# written by epdserve plan")
