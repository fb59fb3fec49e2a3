"""A tensor-parallel rank other than 0: `python -m epdserve.engine.tp_rank FD SPEC_JSON`.

Started by rank 0 (engine/tp/group.py) with one end of a socket pair as file descriptor FD.
Loads the checkpoint with only its shard of the LM's decoder layers (engine/lm/shard_loader.py)
and the vision tower whole (the LM head is freed: rank 0 alone computes logits), builds a KV cache for its own KV heads with rank 0's block count,
joins the group, says "ready", then runs what rank 0 sends until rank 0 says stop or its socket
ends: ("forward", block copies, ForwardInputs) — the same forward as rank 0's
(engine/forward_inputs.py) —, ("encode", pixel values, grids) — its share of an encoder call,
answered with the features (engine/tp/encode_dp.py) — and ("kv", message) — its part of a
disaggregated P or D engine's KV connector (transfer/kv/rank_part.py: this rank sends or receives
its own KV heads; its forward sends them layer by layer). What goes wrong while loading is sent
back as the start-up error.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

log = logging.getLogger("epdserve.tp_rank")


def serve(spec, conn: Connection) -> None:
    import torch
    from torch.distributed import TCPStore
    from datetime import timedelta

    from epdserve.engine.kv_cache import KVCacheSpec, PagedKVCache
    from epdserve.engine.loaded_model import load_model
    from epdserve.engine.model_runner import ModelRunner
    from epdserve.engine.tp.group import START_TIMEOUT_S, all_reduce, make_group
    from epdserve.engine.tp.shard import TPShard
    from epdserve.engine.tp.shm_reduce import ShmReduce
    from epdserve.ops.select import layer_ops, paged_ops

    if spec.cores is not None:  # CPU: this rank's share of the cores (group.py rank_cores)
        os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.threads)
    store = TCPStore("127.0.0.1", spec.store_port, spec.size, False, timeout=timedelta(seconds=START_TIMEOUT_S))
    model = load_model(spec.model, spec.device, spec.dtype, spec.max_model_len, shard=TPShard(spec.rank, spec.size),
                       quantization=spec.quantization)
    pg = make_group(model.platform, store, spec.rank, spec.size, spec.timeout_s)
    a, lm = model.adapter, model.lm
    _drop_lm_head(a, lm)
    lm.reduce = lambda t: all_reduce(pg, t)
    if spec.shm_path:  # CPU: the shared-memory all-reduce; rank 0 has stopped waiting once it wrote to the socket
        lm.reduce = ShmReduce(spec.shm_path, spec.rank, spec.size, spec.shm_capacity, lm.reduce, spec.timeout_s,
                              alive=lambda: not conn.poll(0))
    kv = PagedKVCache(KVCacheSpec(a.num_layers, lm.num_kv_heads, a.head_dim, spec.block_size, model.dtype),
                      spec.num_blocks, model.device)
    ops = paged_ops(model.platform, spec.ops)
    runner = ModelRunner(a, lm, kv, ops, layer_ops(model.platform, spec.ops), model.platform, None,
                         max_batch=spec.max_num_seqs, max_model_len=spec.max_model_len, enforce_eager=True)
    try:
        _serve_loop(conn, kv, runner, a, model.platform, spec.rank)
    finally:
        if runner.connector is not None:
            runner.connector.close()  # its pair threads end before the interpreter does


def _serve_loop(conn, kv, runner, a, platform, rank: int) -> None:
    import torch

    conn.send_bytes(b"ready")
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # rank 0 is gone
        if msg is None:
            return
        kind, *body = msg
        with torch.inference_mode():
            if kind == "forward":
                copies, inputs = body
                kv.copy_blocks(list(copies))
                if inputs is not None:
                    runner.forward(inputs)
            elif kind == "encode":  # its share of an encoder call (engine/tp/encode_dp.py)
                conn.send_bytes(pickle.dumps(_encode(a, *body), protocol=pickle.HIGHEST_PROTOCOL))
            elif kind == "kv":  # its part of rank 0's KV connector, which names the class (a seam)
                msg = body[0]
                if msg[0] == "part":
                    runner.connector = msg[1](kv, platform, rank)  # this rank's forward sends through it
                else:
                    runner.connector.apply(msg)


def _drop_lm_head(adapter, lm) -> None:
    """Rank 0 alone computes logits: another rank frees the LM head (vocabulary x hidden, e.g.
    2.5 GB in bf16 for Qwen2.5-VL-72B) unless it is the embedding's own weight (tied)."""
    import torch

    head = adapter.lm_head.weight
    if head.data_ptr() != adapter.embed.weight.data_ptr():
        head.data = torch.empty(0, dtype=head.dtype, device=head.device)
    lm.head = None


def _encode(adapter, pixel_values, grids) -> tuple[str, object]:
    """("ok", features on the host) or ("error", why): a bad input fails rank 0's step, not this rank."""
    try:
        return "ok", [[t.cpu() for t in feats] for feats in adapter.encode_images(pixel_values, grids)]
    except Exception as e:  # noqa: BLE001 - sent back and raised on rank 0
        return "error", f"{type(e).__name__}: {e}"


def _die_with_parent() -> None:
    """Linux: this rank is killed when rank 0's process ends, however it ends (even while this
    rank is stuck in a collective or a kernel and would never read its socket's end). prctl(2)'s
    "parent" is the thread that started the rank: the engine starts its group on the thread it
    steps on (an instance worker's loop thread, the offline LLM's caller), which outlives it."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # rank 0 ended before the request took
        os._exit(1)


def main(argv: list[str]) -> int:
    from epdserve.engine.tp.group import RankFailure, RankSpec

    _die_with_parent()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(argv[0]))
    spec = RankSpec(**json.loads(argv[1]))
    try:
        serve(spec, conn)
    except RankFailure as e:
        log.error("rank %d: %s", spec.rank, e)
        return 1
    except Exception as e:
        log.error("rank %d failed: %s", spec.rank, traceback.format_exc())
        try:
            conn.send_bytes(f"rank {spec.rank}: {type(e).__name__}: {e}".encode())
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
