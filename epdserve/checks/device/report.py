"""The Markdown of a `bench device` report: one table per part (exactness, modes, decode speed).

Owns `markdown(report)`; the report is the JSON `bench device` writes (`parts.<name>.figures` are
each part's own figures, `status` how the part ended). A missing figure prints as "—".
"""
from __future__ import annotations


def _v(x, unit: str = "") -> str:
    if x is None or x == "":
        return "—"
    if isinstance(x, float):
        x = f"{x:.3g}" if abs(x) < 1 else f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x}{unit}"


def _exact(fig: dict) -> list[str]:
    rows = ["| family / dtype | equal to transformers `generate` | common prefix (one image, two images, text) |",
            "|---|---:|---|"]
    for key, v in fig.items():
        if not isinstance(v, dict):
            continue
        if "equal" not in v:
            rows.append(f"| {key} | FAILED | {v.get('error', '')[:200]} |")
            continue
        prefix = ", ".join(str(n) for n in v["common_prefix"].values())
        rows.append(f"| {key} | {v['equal']}/{v['of']} | {prefix} of {v['tokens']} |")
    return rows


def _tp(fig: dict) -> list[str]:
    if "skipped" in fig:
        return [f"skipped: {fig['skipped']}"]
    hops = [f"{k}: P on {v['p_devices']}, D on {v['d_device']}, {v['hop']} hop, {v['kv_bytes']} KV bytes"
            for k, v in fig.items() if k.startswith("hop/") and isinstance(v, dict) and "hop" in v]
    return _exact(fig) + ["", "media encoded per rank: " + ", ".join(
        f"{k} {v.get('media_encoded_by_rank')}" for k, v in fig.items()
        if isinstance(v, dict) and "equal" in v and not k.startswith("hop/"))] + hops


def _graphs(fig: dict) -> list[str]:
    if "skipped" in fig:
        return [f"skipped: {fig['skipped']}"]
    ev, tp = fig.get("evidence", {}), fig.get("tpot_ms", {})
    rows = ["| figure | value |", "|---|---|"]
    rows += [f"| greedy tokens with graphs = eager, batch {k[5:]} | {v['equal']}/{v['of']} |"
             for k, v in fig.items() if k.startswith("batch") and isinstance(v, dict)]
    rows += [f"| graphs | {'on' if ev.get('graphs') else 'off: ' + str(ev.get('why_off'))} |",
             f"| keys captured (capture s) | {_v(ev.get('keys'))} ({_v(ev.get('capture_s'), ' s')}) |",
             f"| replays; eager decode steps by reason | {_v(ev.get('replays'))}; {ev.get('eager_decode_steps')} |"]
    rows += [f"| TPOT {b}: graphs / eager | {_v(v.get('graphs'), ' ms')} / {_v(v.get('eager'), ' ms')} "
             f"(x{_v(v.get('eager_over_graphs'))}) |" for b, v in tp.items()]
    for name in ("graphs", "eager"):
        la = fig.get(f"launches_{name}", {})
        rows.append(f"| {name}, per decode token at batch 1: device kernels; kernel / graph launches | "
                    + (f"error: {la['error']}" if "error" in la else f"{_v(la.get('device_kernels'))}; "
                       f"{_v(la.get('kernel_launches'))} / {_v(la.get('graph_launches'))}") + " |")
    return rows + [f"| final empty_cache() | {fig.get('empty_cache', 'n/a')} |"]


def _serve(fig: dict) -> list[str]:
    rows = ["| mode | ready (s) | served = offline | P→D KV hop |", "|---|---:|---:|---|"]
    for mode, v in fig.items():
        if not isinstance(v, dict):
            continue
        if "equal" not in v:
            rows.append(f"| {mode} | — | FAILED: {v.get('error', '')[:200]} | |")
            continue
        rows.append(f"| {mode} | {v['ready_s']} | {v['equal']}/{v['of']} | {v['kv_hop']} |")
    return rows


def _perf(fig: dict) -> list[str]:
    model = fig.get("model", {})
    b = model.get("batch", 32)
    rows = [f"Model: demo `--size {model.get('size', '?')}` ({_v(model.get('lm_params_M'))} M LM parameters), "
            f"{model.get('tokens', '?')} new tokens; bandwidth {_v(model.get('bandwidth_Bps'), ' B/s')}.", ""]
    for dtype, v in fig.items():
        if dtype in ("model", "elapsed_s", "error") or not isinstance(v, dict):
            continue
        floor = v.get("floor_ms")
        floor_txt = f"{_v(floor, ' ms')} ({_v(v.get('lm_param_GB'))} GB / bandwidth)" if floor != "n/a" else "n/a"
        tok = v.get(f"epd_decode_tok_s_b{b}")
        hf_tok = v.get(f"hf_decode_tok_s_b{b}")
        rows += [f"**{dtype}**", "",
                 "| figure | epdserve | transformers `generate` (eager) | memory floor |", "|---|---:|---:|---:|",
                 f"| decode TPOT, batch 1 | {_v(v.get('epd_tpot_b1_ms'), ' ms')} | {_v(v.get('hf_tpot_b1_ms'), ' ms')} "
                 f"| {floor_txt} |",
                 f"| decode TPOT, batch {b} | {_v(v.get(f'epd_tpot_b{b}_ms'), ' ms')} ({_v(tok, ' tok/s')}) "
                 f"| {_v(v.get(f'hf_tpot_b{b}_ms'), ' ms')} ({_v(hf_tok, ' tok/s')}) | — |",
                 f"| device kernels per token, batch 1 (per LM layer, at most) | "
                 f"{_v(v.get('device_kernels_per_token_b1'))} ({_v(v.get('kernels_per_layer_b1'))}) | | |",
                 f"| host aten ops per token, batch 1 | {_v(v.get('aten_ops_per_token_b1'))} | | |",
                 f"| host profiler events per token, batch 1 | {_v(v.get('host_events_per_token_b1'))} | | |",
                 f"| kernel / graph launches per token, batch 1 | {_v(v.get('kernel_launches_per_token_b1'))} / "
                 f"{_v(v.get('graph_launches_per_token_b1'))} | | |",
                 f"| attention kernels that ran | {', '.join(v.get('attention_kernels') or []) or 'n/a'} | | |",
                 f"| decode graphs: keys (capture s), replays, eager decode steps | {v.get('graphs', 'n/a')}: "
                 f"{_v(v.get('graph_keys'))} ({_v(v.get('graph_capture_s'), ' s')}), {_v(v.get('graph_replays'))}, "
                 f"{_v(v.get('eager_decode_steps'))} | | |",
                 f"| paged attention operators | {v.get('paged_ops', 'n/a')} | | |",
                 f"| served TPOT, one request alone (server stamps; client) | {_v(v.get('served_tpot_b1_ms'), ' ms')}; "
                 f"{_v(v.get('served_client_tpot_b1_ms'), ' ms')} (x{_v(v.get('served_over_offline_b1'))} offline) "
                 f"| | |", ""]
        for key in ("profile_error", "served_error"):
            if v.get(key):
                rows += [f"{key}: {v[key][:300]}", ""]
    return rows


TITLES = {"exact": "Exactness: offline LLM greedy vs transformers greedy `generate`, same device",
          "serve": "Every mode launched on the device: served greedy tokens vs offline",
          "perf": "Decode speed, offline (and one request served)",
          "tp": "Tensor parallelism: LLM(tensor_parallel_size=2) greedy vs transformers on one device",
          "graphs": "Decode graphs: greedy tokens and TPOT against --enforce-eager, and the evidence"}


def markdown(report: dict) -> str:
    lines = [f"# epdserve device check: {report.get('device')} ({report.get('device_name', '')})", "",
             f"torch {report.get('torch')}, commit {report.get('commit') or '?'}, {report.get('started')}", ""]
    for part, entry in report.get("parts", {}).items():
        lines += [f"## {part}: {TITLES.get(part, '')}", "",
                  f"status: {entry.get('status')} in {_v(entry.get('elapsed_s'), ' s')} "
                  f"(timeout {entry.get('timeout_s')} s)", ""]
        fig = entry.get("figures", {})
        if fig.get("error"):
            lines += [f"error: {fig['error']}", ""]
        lines += {"exact": _exact, "serve": _serve, "perf": _perf, "tp": _tp, "graphs": _graphs}[part](fig) + [""]
    return "\n".join(lines)
