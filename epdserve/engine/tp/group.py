"""`TPGroup`: rank 0's side of a tensor-parallel instance — the rank processes, the group, and
each forward's inputs sent to the other ranks.

Rank 0 is the engine's own process: it schedules, samples and runs the LM head. Ranks 1..tp-1
are processes of their own (`python -m epdserve.engine.tp_rank`, started with a plain
`subprocess`, so a user's script is never imported again as `multiprocessing`'s spawn would),
each on its own device (`rank_device`). Before each forward rank 0 sends every other rank the
step's `ForwardInputs` (engine/forward_inputs.py) and its block copies, pickled, over a socket
pair inherited by the rank; the ranks then run the same forward, meeting in two all-reduces per
layer on a group the platform builds (`Platform.make_pair_group`: gloo on the CPU, NCCL on CUDA,
HCCL on the NPU). The inputs go over the socket, not the group, so an idle rank blocks on its
socket with no collective timing out; a rank sees rank 0's end as the socket's end and exits.

Failure: a rank that died (its socket closed, its process gone) or a collective that failed or
outlived `timeout_s` raises `RankFailure` (gloo: the wait's own timeout). On CUDA and the NPU a
collective's wait does not block the host, so the bound is the backend's watchdog, left in
TearDown for a TP group (`Platform.tp_group_env`, the opposite of the KV pairs' setting; a P or D
instance holds both: `Platform.prepare_pair_groups`): it ends the process when a collective fails
or outlives the group's timeout. The engine does not catch it: the instance ends as a
whole and its supervisor restarts it; no half-alive instance serves.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from epdserve.engine.tp.failure import RankFailure
from epdserve.engine.tp import shm_reduce

__all__ = ["RankFailure", "RankSpec", "TPGroup", "all_reduce", "make_group", "rank_cores", "rank_device"]

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # a rank waits this long in an all-reduce for the others (one layer's work apart)
START_TIMEOUT_S = 600.0  # a rank's process start and checkpoint load


@dataclass(frozen=True)
class RankSpec:
    """What a rank other than 0 needs to build its part (JSON on its command line)."""

    model: str
    device: str
    dtype: str
    max_model_len: int
    rank: int
    size: int
    store_port: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    ops: str | None
    quantization: str | None = None  # the LM linears' method (engine/lm/linear.py LINEAR_METHODS); None: dense
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    cores: list[int] | None = None  # CPU: the cores this rank's threads run on
    threads: int | None = None  # CPU: its intra-op threads
    shm_path: str | None = None  # CPU: the shared-memory all-reduce's file (shm_reduce.py)
    shm_capacity: int = 0


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: "cpu" for every rank; "cuda" / "npu:2" → the base index plus the rank."""
    name, _, idx = device.partition(":")
    if name == "cpu":
        return "cpu"
    return f"{name}:{(int(idx) if idx.isdigit() else 0) + rank}"


def rank_cores(device: str, size: int) -> list[tuple[list[int], int]] | None:
    """CPU: each rank's (cores, intra-op threads) out of the cores this process may use —
    disjoint, contiguous shares while there are at least as many cores as ranks
    (`platform/cores.py split_cores`: rank 0 first, the remainder to the first ranks), else every core shared and the threads
    divided — so `size` ranks' thread teams do not oversubscribe the cores each would otherwise
    take whole; None on an accelerator (a rank has its own device)."""
    if not device.startswith("cpu"):
        return None
    from epdserve.platform.cores import available_cores, split_cores

    cores = available_cores()
    if len(cores) < size:  # every core shared (split_cores' answer too): the threads divided
        return [(cores, max(1, len(cores) // size))] * size
    return [(share, len(share)) for share in split_cores(size, cores)]


def make_group(platform, store, rank: int, size: int, timeout_s: float):
    """The platform's group of the `size` ranks over `store` (built by every rank at once)."""
    return platform.make_pair_group(store, rank, size, timedelta(seconds=timeout_s), group_name="tp",
                                    tensor_parallel=True,
                                    host="127.0.0.1" if platform.name == "cpu" else None)


def all_reduce(pg, tensor) -> None:
    """Sum `tensor` over the group in place; RankFailure when a rank is gone or late."""
    try:
        pg.allreduce([tensor]).wait()
    except RuntimeError as e:
        raise RankFailure(f"tensor-parallel all-reduce failed (a rank died or hung): {e}") from e


def loopback_store(size: int):
    """The group's rendezvous store, listening on 127.0.0.1 only (a TCPStore bound by itself
    listens on every interface: so it is handed a socket bound here, `master_listen_fd`)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(size, 8))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return TCPStore("127.0.0.1", port, size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
                    wait_for_workers=False, master_listen_fd=sock.detach())  # the store owns the socket now


class TPGroup:
    def __init__(self, platform, size: int, spec: dict, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 reduce_bytes: int = 0):
        """Start ranks 1..size-1 for `spec` (RankSpec's fields but rank, size and store_port) and
        join them in a group; returns once every rank has loaded its part. `reduce_bytes`: the
        largest all-reduce the shared-memory path takes on the CPU (a decode step's hidden
        states; larger ones go through gloo); 0: gloo only."""
        self.size, self.platform = size, platform
        self._store = loopback_store(size)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._shm = None
        capacity = -(-reduce_bytes // 64) * 64
        shm_path = shm_reduce.create_file(size, capacity) \
            if capacity and platform.name == "cpu" and shm_reduce.usable() else None
        shares = rank_cores(spec["device"], size)
        if shares is not None:  # rank 0's team: the calling thread's (its cores stay as they are)
            import torch

            torch.set_num_threads(shares[0][1])
        try:
            for rank in range(1, size):
                mine, theirs = socket.socketpair()
                cores, threads = shares[rank] if shares is not None else (None, None)
                rs = RankSpec(**spec, rank=rank, size=size, store_port=self._store.port, timeout_s=timeout_s,
                              cores=cores, threads=threads, shm_path=shm_path, shm_capacity=capacity)
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "epdserve.engine.tp_rank", str(theirs.fileno()), json.dumps(asdict(rs))],
                    pass_fds=[theirs.fileno()], env=dict(os.environ)))
                theirs.close()
                self._conns.append(Connection(mine.detach()))
            self.pg = make_group(platform, self._store, 0, size, timeout_s)
            if shm_path:
                self._shm = shm_reduce.ShmReduce(shm_path, 0, size, capacity, lambda t: all_reduce(self.pg, t),
                                                 timeout_s, alive=self._ranks_alive)
            for rank, conn in enumerate(self._conns, 1):
                self._await_ready(rank, conn)
        except BaseException:
            self.close()
            raise
        finally:
            if shm_path:
                os.unlink(shm_path)  # every rank has it mapped (or failed): nothing left in /dev/shm
        log.info("tensor-parallel group of %d ranks ready (%s)", size, platform.dist_backend)

    def _await_ready(self, rank: int, conn: Connection) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(1.0):
            if self._procs[rank - 1].poll() is not None:
                raise RankFailure(f"tensor-parallel rank {rank} exited with {self._procs[rank - 1].returncode} "
                                  f"while loading (its log is above)")
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel rank {rank} did not load within {START_TIMEOUT_S:g} s")
        try:
            msg = conn.recv_bytes()
        except EOFError:
            msg = b""
        if msg != b"ready":
            raise RankFailure(f"tensor-parallel rank {rank} failed to start: {msg.decode(errors='replace')}")

    def reduce(self, tensor) -> None:
        if self._shm is not None:
            self._shm(tensor)
        else:
            all_reduce(self.pg, tensor)

    def _ranks_alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def send(self, inputs, block_copies=()) -> None:
        """Send one forward's inputs (and the block copies before it) to every other rank."""
        payload = pickle.dumps(("forward", tuple(block_copies), inputs.to_host() if inputs is not None else None),
                               protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.size):
            self.send_to(rank, payload)

    def tell_kv(self, message: tuple) -> None:
        """One message of rank 0's KV connector to every other rank (transfer/kv/rank_part.py)."""
        payload = pickle.dumps(("kv", message), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.size):
            self.send_to(rank, payload)

    def send_to(self, rank: int, payload: bytes) -> None:
        """One pickled message to rank `rank` (`engine/tp_rank.py` says which it takes)."""
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        try:
            conn.send_bytes(payload)
        except OSError as e:
            raise RankFailure(f"tensor-parallel rank {rank} is gone (exit {proc.poll()}): {e}") from e

    def receive_from(self, rank: int):
        """Rank `rank`'s answer to a message that has one (unpickled)."""
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise RankFailure(f"tensor-parallel rank {rank} is gone (exit {proc.poll()}): {e}") from e

    def close(self) -> None:
        """End every rank (told to stop, then terminated if it lingers)."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._conns, self._procs = [], []
        if self._shm is not None:
            self._shm.close()
        self.pg = self._store = self._shm = None  # the store's listener goes with it
