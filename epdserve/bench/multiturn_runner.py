"""Drive multi-turn conversations against one live deployment: closed loop per conversation.

Owns `run_conversations`: conversations start on the run's arrival schedule (RunConfig's rate and
burstiness: conversations per second; `max_concurrency`: at most that many conversations at
once); inside a conversation, turn t+1 is built from the answers received so far and sent only
after turn t has finished and the conversation's think time has passed. Each turn is one
`send_one` (bench/serve_runner.py), its record tagged with the turn. A failed turn ends its
conversation: the turns it never sent are recorded as failures (they count against goodput).
Records come back conversation by conversation, turns in order.
"""
from __future__ import annotations

import threading
import time

from epdserve.bench.serve_runner import Backend, RunConfig, dispatch_at, send_one
from epdserve.perf.arrivals import arrival_times
from epdserve.perf.multiturn import Conversation
from epdserve.perf.serving_metrics import RequestRecord


def converse(backend: Backend, conv: Conversation, on_turn=None) -> list[RequestRecord]:
    """One conversation's turns, each after the previous answer plus the think time."""
    records, answers = [], []
    for t in range(conv.turns):
        if t:
            time.sleep(conv.think_time_s)
        rec = send_one(backend, conv.request(t, answers))
        records.append(rec)
        if on_turn:
            on_turn()
        if not rec.success:
            records += [_not_sent(conv, later, rec.request_id) for later in range(t + 1, conv.turns)]
            if on_turn:
                for _ in range(t + 1, conv.turns):
                    on_turn()
            break
        answers.append(rec.output_text)
    return records


def run_conversations(backend: Backend, conversations: list[Conversation], cfg: RunConfig) -> list[RequestRecord]:
    """Every conversation, started on cfg's schedule; their records, conversation by conversation."""
    starts = arrival_times(len(conversations), cfg.rate, cfg.burstiness, cfg.seed)
    limit = threading.BoundedSemaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[list[RequestRecord]] = [[] for _ in conversations]
    bar = _progress(sum(c.turns for c in conversations), cfg)
    lock = threading.Lock()

    def tick() -> None:
        if bar is not None:
            with lock:
                bar.update(1)

    def work(i: int) -> None:
        try:
            results[i] = converse(backend, conversations[i], tick)
        finally:
            if limit:
                limit.release()

    dispatch_at(starts, work, limit, cfg, "bench-conv")
    if bar is not None:
        bar.close()
    return [r for conv in results for r in conv]


def _not_sent(conv: Conversation, turn: int, failed_id: str) -> RequestRecord:
    now = time.monotonic()
    return RequestRecord(f"{conv.conversation_id}-t{turn + 1}", t0=now, num_images=len(conv.images),
                         t0_wall=time.time(), end=now, error=f"not sent: {failed_id} failed",
                         expected_output_tokens=conv.max_tokens[turn], turn=turn + 1)


def _progress(total: int, cfg: RunConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=cfg.label or "turns", unit="turn", leave=False, dynamic_ncols=True)
