"""Encode stage: gets every media item of a request its features, then hands the request on.

Per media item, in order of preference:
1. the `FeatureProvider` already has it (local cache, or the MM Store filled by an E instance):
   an encode-role engine only checks that it exists; a prefill-side engine loads it;
2. this engine encodes it (its role includes E) and saves it to the provider;
3. a prefill-only engine waits up to `wait_s` (polled each step, never blocking the loop) for
   the feature to arrive, then recomputes it with its own vision encoder — same output,
   counted in `recomputes`. An item without raw media cannot be recomputed: that request fails.
At most `max_images_per_step` images are encoded per engine step, batched in one call.
"""
from __future__ import annotations

import time

from epdserve.transfer.feature_provider import FeatureProvider
from epdserve.engine.sequence import MediaItem, RequestState, Sequence
from epdserve.engine.stats import EngineStats
from epdserve.model.adapter import VLMAdapter


class EncodeStage:
    def __init__(self, adapter: VLMAdapter, features: FeatureProvider, *, encodes: bool, prefills: bool,
                 wait_s: float, max_images_per_step: int, stats: EngineStats):
        self.adapter = adapter
        self.features = features
        self.encodes = encodes
        self.prefills = prefills
        self.wait_s = wait_s
        self.max_images_per_step = max_images_per_step
        self.stats = stats
        self.pending: list[Sequence] = []
        self.recomputes = 0
        self.encoder_runs = 0

    def add(self, seq: Sequence) -> None:
        seq.state = RequestState.WAITING_FOR_FEATURES
        self.pending.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.pending:
            self.pending.remove(seq)

    def step(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """Advance every pending request; returns (ready requests, failed (request, message))."""
        now = time.monotonic()
        todo: list[tuple[Sequence, MediaItem]] = []
        failed: list[tuple[Sequence, str]] = []
        for seq in self.pending:
            for m in seq.media:
                if m.features is not None or any(m is o for _, o in todo):
                    continue
                if self._from_provider(m):
                    continue
                if not self.encodes and (m.wait_since is None or now - m.wait_since < self.wait_s):
                    if m.wait_since is None:
                        m.wait_since = now
                    if self.wait_s > 0:
                        continue
                if m.input is None:
                    failed.append((seq, f"features of media {m.key} are not in the store and its bytes were not sent"))
                    break
                if len(todo) < self.max_images_per_step:
                    todo.append((seq, m))
        if todo:
            self._encode(todo)
        bad = {id(s) for s, _ in failed}
        ready = [s for s in self.pending if id(s) not in bad and all(m.features is not None for m in s.media)]
        for seq in ready + [s for s, _ in failed]:
            self.pending.remove(seq)
            seq.timings["encode_end"] = time.time()
        return ready, failed

    def _from_provider(self, m: MediaItem) -> bool:
        if self.encodes and not self.prefills:
            if self.features.contains(m.key):  # E-only: the store has it, nothing to move
                m.features, m.from_store = [], True
                return True
            return False
        feats = self.features.load(m.key, 0.0)
        if feats is None:
            return False
        m.features, m.from_store = feats, True
        return True

    def _encode(self, todo: list[tuple[Sequence, MediaItem]]) -> None:
        for seq, _ in todo:
            seq.timings.setdefault("encode_start", time.time())
        # one encoder run per distinct key; duplicates in flight share the result
        unique: dict[str, MediaItem] = {}
        for _, m in todo:
            unique.setdefault(m.key, m)
        t0 = time.perf_counter()
        feats = self.adapter.encode_images([m.input.pixel_values for m in unique.values()],
                                           [m.grid_thw for m in unique.values()])
        self.stats.record_vision(len(unique), time.perf_counter() - t0)
        self.encoder_runs += len(unique)
        if not self.encodes:
            self.recomputes += len(unique)
        by_key = dict(zip(unique, feats))
        for seq, m in todo:
            m.features = by_key[m.key]
        for key, f in by_key.items():
            owner = next(s for s, m in todo if m.key == key)
            if self.encodes:
                self.features.save(key, f, request_id=owner.request_id, target=owner.feature_target)
        for seq in self.pending:  # the same image in another pending request
            for m in seq.media:
                if m.features is None and m.key in by_key:
                    m.features = by_key[m.key]
