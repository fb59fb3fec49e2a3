"""The steps of scripts/npu_first_run.sh — what someone with a fresh Atlas 800I A2 runs first —
one command each, each printing table rows `step<TAB>status<TAB>detail` (status ok / fail /
refused / skip), exit 1 when a row failed:

  python -m epdserve.checks.npu.first_run versions   driver / CANN / torch_npu against the table
                                                     (platform/npu_versions.py)
  ... probe     the operator schemas (ops/npu_schema.py) and the start-up attention check
                (ops/npu_attention_check.py: one tiny TND + paged call, bf16, head_dim 128)
  ... matrix    head_dim 64 / 128 x bf16 / fp16 x all-decode / decode + prompt chunk / fresh
                prompt: NpuPagedOps (KV write, then one attention call) against PortableOps in
                float32, max error; fp16 (the same call, past NpuPagedOps' bf16 check) must be
                refused by the kernel (PFA's TND tiling takes bf16 only)
  ... hccl      a two-rank HCCL pair (NpuPlatform.make_pair_group, a second process as the
                sender): one message, then the sender killed while the receiver waits for the
                next: the receive must time out, the pair be interrupted (abort_hccl_comm), and
                the bound for the blocks it may still write (HCCL_EXEC_TIMEOUT) be finite
  ... limits    core limits under the profiler: `epdserve bench colocation --device npu`
                (skip where torch_npu has no profiler)
  ... graphs    decode graphs (NPUGraph + FIA task updates) against eager, token for token, with
                the graph evidence (keys, replays, eager steps by reason); refused, with the
                reason, where the torch_npu line lacks the graph-task API
  ... pd        a PD engine (offline LLM, roles PD) on the device against transformers' greedy
                generate, token for token

`--device` (default npu) names the device tensors go to; the test runs the script against the
fake torch_npu (tests/fakes/, put in place by a sitecustomize) with `--device cpu`. Nothing here
is imported by the serving path.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch

from epdserve.platform import get_platform

TIMEOUT_S = 5.0  # the receive the killed peer never completes
HEAD_DIMS, DTYPES = (64, 128), (torch.bfloat16, torch.float16)
CASES = {"all-decode": ([1, 1, 1], [37, 130, 5]), "decode+chunk": ([1, 45, 1], [300, 300, 129]),
         "fresh prompt": ([130], [130])}


def row(step: str, status: str, detail: str) -> bool:
    print(f"{step}\t{status}\t{' '.join(detail.split())}", flush=True)
    return status != "fail"


# ---------------------------------------------------------------- versions, probe
def versions(_args) -> bool:
    import importlib.metadata

    from epdserve.checks.doctor import cann_version
    from epdserve.checks.npu.doctor_rows import installed_versions
    from epdserve.platform.npu_versions import check

    tnpu, cann, driver = installed_versions(cann_version)
    ok = row("versions", "ok", f"torch {torch.__version__}, torch_npu {tnpu or '?'}, CANN {cann or '?'}, "
             f"driver {driver or '?'}, epdserve {importlib.metadata.version('epdserve')}")
    for f in check(tnpu or None, cann or None, driver or None):
        ok &= row("versions", f.status, f.detail + (f" -- fix: {f.fix}" if f.fix else ""))
    return ok


def probe(args) -> bool:
    from epdserve.engine.kv_cache import KVCacheSpec
    from epdserve.ops.npu_ops import NpuPagedOps
    from epdserve.ops.npu_schema import NpuKernelsUnsupported

    try:
        ops = NpuPagedOps()
    except NpuKernelsUnsupported as e:
        return row("schema probe", "fail", str(e))
    row("schema probe", "ok", f"torch_npu {get_platform('npu').torch_npu_version()}: KV write {ops.kv_write}")
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=128, block_size=128, dtype=torch.bfloat16)
    try:
        ops.check_kv_spec(spec, 8, torch.device(args.device))
    except NpuKernelsUnsupported as e:
        return row("attention check", "fail", str(e))
    return row("attention check", "ok", "FIA TND + paged, bf16, head_dim 128: a decode row and a chunk, right")


# ---------------------------------------------------------------- kernel matrix
def matrix(args) -> bool:
    from epdserve.ops.attention_meta import VarlenBatch
    from epdserve.ops.npu_ops import NpuPagedOps
    from epdserve.ops.portable import PortableOps

    dev, ops, ok = torch.device(args.device), NpuPagedOps(), True
    for head_dim in HEAD_DIMS:
        for dtype in DTYPES:
            for case, (q_lens, kv_lens) in CASES.items():
                name = f"matrix hd{head_dim} {str(dtype)[6:]} {case}"
                try:
                    err = _matrix_case(ops, PortableOps(), VarlenBatch, head_dim, dtype, q_lens, kv_lens, dev)
                except (TypeError, RuntimeError) as e:  # the kernel refused: what fp16 must get
                    status = "refused" if dtype != torch.bfloat16 else "fail"
                    ok &= row(name, status, f"{type(e).__name__}: {str(e)[:160]}")
                    continue
                if dtype != torch.bfloat16:
                    ok &= row(name, "fail", f"accepted (max error {err:.2e}) where PFA's TND tiling takes bf16 only")
                else:
                    ok &= row(name, "ok" if err <= 3e-2 else "fail", f"max error {err:.2e} vs float32")
    return ok


def _matrix_case(ops, portable, VarlenBatch, head_dim, dtype, q_lens, kv_lens, dev) -> float:
    heads, kv_heads, bs = 8, 2, 128
    g = torch.Generator().manual_seed(head_dim + len(q_lens))
    need = [-(-n // bs) for n in kv_lens]
    nb = sum(need) + 1
    kc = torch.zeros(nb, bs, kv_heads, head_dim, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    tables = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    slots, nxt = [], 1
    for b, n in enumerate(need):
        tables[b, :n] = torch.arange(nxt, nxt + n)
        nxt += n
        slots += [int(tables[b, p // bs]) * bs + p % bs for p in range(kv_lens[b])]
    k = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype).to(dev)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype).to(dev)
    ops.reshape_and_cache(k, v, kc, vc, torch.tensor(slots).to(dev))
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype).to(dev)
    ends = tuple(int(e) for e in torch.tensor(q_lens).cumsum(0))
    batch = VarlenBatch(tables.to(dev), ends, tuple(kv_lens))
    if dtype == torch.bfloat16:
        out = ops.varlen_attention(q, kc, vc, batch, head_dim ** -0.5)
    else:  # past NpuPagedOps' own bf16 check: what the kernel itself answers, the same call
        from epdserve.ops.npu_ops import _heads_and_layout, _paged_kv

        out, _ = ops._torch_npu().npu_fused_infer_attention_score(
            q, *_paged_kv(kc, vc), atten_mask=ops._causal_mask(dev), sparse_mode=3, block_table=batch.block_tables,
            actual_seq_lengths=list(ends), actual_seq_lengths_kv=list(kv_lens),
            **_heads_and_layout(q, kc, head_dim ** -0.5))
    kc32, vc32, q32 = kc.float().cpu(), vc.float().cpu(), q.float().cpu()
    err = 0.0
    for b, (end, n) in enumerate(zip(ends, q_lens)):
        want = portable.prefill_attention(q32[end - n:end], kc32, vc32, tables[b].long(), kv_lens[b], head_dim ** -0.5)
        err = max(err, (out[end - n:end].float().cpu() - want).abs().max().item())
    return err


# ---------------------------------------------------------------- HCCL pair, a peer killed
def hccl(args) -> bool:
    from epdserve.engine.tp.group import loopback_store
    from epdserve.platform import get_platform

    platform = get_platform("npu")
    platform.set_thread_device(0)
    peer_index, where = hccl_placement(platform.device_count())
    store = loopback_store(2)  # listens on 127.0.0.1 only (a TCPStore binding itself takes every interface)
    peer = subprocess.Popen([sys.executable, "-m", "epdserve.checks.npu.first_run", "hccl-peer", "--device", args.device,
                             "--port", str(store.port), "--index", str(peer_index)], stdout=subprocess.PIPE, text=True)
    try:
        pg = platform.make_pair_group(store, 1, 2, timedelta(seconds=60), group_name="first-run")
        dev = _device(args.device, 0)
        first = torch.zeros(4, device=dev)
        platform.wait_work(pg.recv([first], 0), 60.0)
        if first.cpu().tolist() != [1.0] * 4:
            return row("hccl pair", "fail", f"{where}; first message wrong: {first.cpu().tolist()}")
        second = torch.zeros(4, device=dev)
        work = pg.recv([second], 0)
        peer.kill()  # mid-receive: the sender dies with our receive posted
        peer.wait(30)
        t0 = time.monotonic()
        try:
            platform.wait_work(work, TIMEOUT_S)
            return row("hccl pair", "fail", f"{where}; the receive completed although its sender was killed")
        except TimeoutError:
            pass
        except RuntimeError as e:
            return row("hccl pair", "ok", f"{where}; peer killed mid-receive: the receive failed ({e}) after "
                       f"{time.monotonic() - t0:.1f} s")
        platform.interrupt_pair_group(pg, 0)
        bound = platform.stuck_work_bound_s()
        status = "ok" if bound is not None and bound != float("inf") else "fail"
        return row("hccl pair", status, f"{where}; first message right; peer killed mid-receive: timed out after {TIMEOUT_S:g} s, "
                   f"pair interrupted (abort_hccl_comm); the receive may write its buffer for {bound:g} s more "
                   "(HCCL_EXEC_TIMEOUT + 30 s: its blocks stay quarantined that long)")
    finally:
        if peer.poll() is None:
            peer.kill()


def hccl_placement(count: int) -> tuple[int, str]:
    """(the peer rank's NPU index, what the row says): HCCL expects one rank per device, so the peer
    goes on NPU 1 when there is one."""
    if count >= 2:
        return 1, "ranks on npu:0 and npu:1"
    return 0, "one NPU visible: both ranks on npu:0 (HCCL expects one rank per device; make two visible)"


def _device(device: str, index: int) -> torch.device:
    """`device` ("npu", or "cpu" under the fake) at NPU index `index`."""
    return torch.device(device, index) if device == "npu" else torch.device(device)


def hccl_peer(args) -> bool:
    from torch.distributed import TCPStore

    from epdserve.platform import get_platform

    platform = get_platform("npu")
    platform.set_thread_device(args.index)
    store = TCPStore("127.0.0.1", args.port, 2, False, timeout=timedelta(seconds=60))
    pg = platform.make_pair_group(store, 0, 2, timedelta(seconds=60), group_name="first-run")
    platform.wait_work(pg.send([torch.ones(4, device=_device(args.device, args.index))], 1), 60.0)
    time.sleep(600)  # killed by the receiver before the second message
    return True


# ---------------------------------------------------------------- core limits, PD end to end
def limits(args) -> bool:
    if not get_platform("npu").has_profiler():
        return row("core limits", "skip", "torch_npu has no profiler here (a stand-in): run on the NPU")
    out = subprocess.run([sys.executable, "-m", "epdserve.entrypoints.cli", "bench", "colocation", "--device", "npu",
                          "--out", os.path.join(args.out_dir, "colocation.json")], capture_output=True, text=True)
    tail = (out.stdout.strip().splitlines() or [""])[-1]
    return row("core limits", "ok" if out.returncode == 0 else "fail", tail or out.stderr.strip()[-300:])


def pd(args) -> bool:
    """Greedy tokens of a PD engine (bf16 on an NPU, the only dtype its attention takes) against
    transformers' generate in float32 on the same device: all equal ok, a common prefix warn
    (bf16 against float32 may part on random weights), none fail."""
    from epdserve.entrypoints.llm import LLM, SamplingParams
    from epdserve.model.demo import build_demo_model
    from epdserve.model.reference import ReferenceGenerator

    # head_dim 128: the size op-plugin's TND attention docs list (a refusal of 64 would blame the CANN, not D)
    model = args.model or build_demo_model(os.path.join(args.out_dir, "demo-small-d128"), size="small-d128")
    prompt, n = "The first run of epdserve on this NPU", 8
    llm = LLM(str(model), device=args.device, roles="PD")
    out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    if out.error is not None:
        return row("pd end to end", "fail", out.error)
    got = out.outputs[0].token_ids
    want = ReferenceGenerator(model, device=args.device).generate(prompt, None, n)
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), n)
    status = "ok" if same == n else "warn" if same else "fail"
    return row("pd end to end", status, f"{args.device}, {llm.engine.model.dtype}, ops {llm.engine.runner.ops.name}: "
               f"{same}/{n} tokens equal transformers' (epdserve {got}, transformers {want})")


def graphs(args) -> bool:
    """Decode graphs (engine/graph_runner.py on torch.npu.NPUGraph, platform/npu_graphs.py): the
    offline LLM with graphs — captured at start-up, then its self-check (engine/graph_check.py) —
    and with enforce_eager, the same three prompts' greedy tokens, and the graph evidence
    (graph_report). ok: graphs on, every decode step replayed, tokens equal; refused: this
    torch_npu lacks the graph-task API or the FIA .out / workspace schemas (the reason); fail:
    graphs turned themselves off (a capture that failed, a self-check difference: the reason) or
    tokens differ. The first run of this step is the first time NPU graphs run on hardware."""
    from epdserve.entrypoints.llm import LLM, SamplingParams
    from epdserve.model.demo import build_demo_model

    plat = get_platform(args.device)
    missing = plat.graphs_unavailable_reason()
    if plat.name == "npu" and not missing:
        from epdserve.ops.npu_ops import NpuPagedOps

        try:
            missing = NpuPagedOps().graphs_unavailable_reason()
        except Exception as e:  # the probe step says more
            return row("decode graphs", "fail", f"{type(e).__name__}: {e}")
    if missing:
        return row("decode graphs", "refused" if plat.name == "npu" else "skip", missing)
    model = args.model or build_demo_model(os.path.join(args.out_dir, "demo-small-d128"), size="small-d128")
    prompts = ["The first decode graph on this NPU", "Graphs replay what they captured, " * 9, "One more"]
    runs = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = LLM(str(model), device=args.device, enforce_eager=eager)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
            runs[name] = ([o.outputs[0].token_ids for o in outs], llm.engine.runner.graph_report())
        finally:
            llm.engine.close()
    (got, report), (want, _) = runs["graphs"], runs["eager"]
    evidence = (f"{report['keys']} keys captured in {report['capture_s']:.1f} s, {report['replays']} replays, "
                f"eager decode steps {report['eager_decode_steps'] or 'none'}")
    if not report["graphs"]:
        return row("decode graphs", "fail", f"graphs turned off: {report['why_off']}; {evidence}")
    equal = sum(g == w for g, w in zip(got, want))
    status = "ok" if equal == len(prompts) and report["replays"] and not report["eager_decode_steps"] else "fail"
    return row("decode graphs", status, f"{equal}/{len(prompts)} prompts' tokens equal eager's; {evidence}")


STEPS = {"versions": versions, "probe": probe, "matrix": matrix, "hccl": hccl, "hccl-peer": hccl_peer,
         "limits": limits, "graphs": graphs, "pd": pd}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epdserve.checks.npu.first_run", description=__doc__.split("\n")[0])
    p.add_argument("step", choices=STEPS)
    p.add_argument("--device", default="npu")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--index", type=int, default=0, help="hccl-peer: the NPU index its rank runs on")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--model", default="", help="pd, graphs: a checkpoint (default: the small demo model with head_dim 128, "
                   "built in --out-dir)")
    args = p.parse_args(argv)
    return 0 if STEPS[args.step](args) else 1


if __name__ == "__main__":
    sys.exit(main())
