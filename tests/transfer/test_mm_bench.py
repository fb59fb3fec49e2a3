"""`epdserve bench mm-store` runs end to end (tiny sizes) and writes its table's JSON."""
import argparse
import json

from epdserve.bench import mm_store


def test_bench_writes_rows_for_both_systems(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    mm_store.add_parser(parser.add_subparsers())
    out = tmp_path / "bench.json"
    args = parser.parse_args(["mm-store", "--tokens", "4", "16", "--hidden", "8", "--iters", "2",
                              "--warmup", "0", "--out", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    rows = {(r["tokens"], r["system"], r["op"]) for r in result["rows"]}
    assert rows == {(t, s, o) for t in (4, 16) for s in ("redis-py", "MMStore") for o in ("put", "get")}
    assert all(r["mb_per_s"] > 0 and r["p50_ms"] > 0 for r in result["rows"])
    assert "MMStore" in capsys.readouterr().out
