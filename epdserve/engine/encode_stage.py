"""Encode stage: gets every media item of a request its features, then hands the request on.

Per media item, in order of preference:
1. the `FeatureProvider` already has it (local cache, or the MM Store filled by an E instance):
   an encode-role engine only checks that it exists; a prefill-side engine loads it;
2. this engine encodes it (its role includes E) and saves it to the provider;
3. a prefill-only engine waits up to `wait_s` (polled each step, never blocking the loop) for
   the feature to arrive, then recomputes it with its own vision encoder — same output,
   counted in `recomputes`. An item without raw media cannot be recomputed: that request fails.
Encoding runs under a vision-token budget per engine step, across requests, round-robin; a
video over the budget is encoded a few temporal patches per step (engine/encode_plan.py), and
its features are stored once, whole, when its last slice is done.
An item's features are one list (the embedding, then Qwen3-VL's DeepStack features): a stored
value with another number of tensors is treated as absent, so it is recomputed.
"""
from __future__ import annotations

import time

from epdserve.engine.compute_gate import NO_GATE
from epdserve.engine.encode_plan import TEMPORAL_SLICING_EXACT, EncodeJob, Slice, pack
from epdserve.engine.sequence import MediaItem, RequestState, Sequence
from epdserve.engine.stats import EngineStats
from epdserve.model.adapter import VLMAdapter
from epdserve.seams.feature_provider import FeatureProvider


class EncodeStage:
    def __init__(self, adapter: VLMAdapter, features: FeatureProvider, *, encodes: bool, prefills: bool,
                 wait_s: float, token_budget: int, stats: EngineStats):
        self.adapter = adapter
        self.features = features
        self.encodes = encodes
        self.prefills = prefills
        self.wait_s = wait_s
        self.token_budget = token_budget
        self.stats = stats
        self.pending: list[Sequence] = []
        self.jobs: dict[str, EncodeJob] = {}  # media key -> its encoding in progress
        self._served: dict[str, int] = {}  # request id -> the last step that encoded a slice of it
        self._steps = 0
        self.recomputes = 0
        self.encoder_runs = 0  # media items encoded (whole, however many slices)
        self.encoder_calls = 0  # vision tower calls
        self.gate = NO_GATE  # the engine's compute gate (LLMEngine.set_gate)

    def add(self, seq: Sequence) -> None:
        seq.state = RequestState.WAITING_FOR_FEATURES
        self.pending.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.pending:
            self.pending.remove(seq)
            self._served.pop(seq.request_id, None)

    def step(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """Advance every pending request; returns (ready requests, failed (request, message))."""
        self._steps += 1
        now = time.monotonic()
        failed: list[tuple[Sequence, str]] = []
        for seq in self.pending:
            for m in seq.media:
                if m.features is not None or m.key in self.jobs or self._from_provider(m):
                    continue
                if not self.encodes and (m.wait_since is None or now - m.wait_since < self.wait_s):
                    if m.wait_since is None:
                        m.wait_since = now
                    if self.wait_s > 0:
                        continue
                if m.input is None:
                    failed.append((seq, f"features of media {m.key} are not in the store and its bytes were not sent"))
                    break
                self.jobs[m.key] = self._job(m)
        bad = {id(s) for s, _ in failed}
        live = [s for s in self.pending if id(s) not in bad]
        needed = {m.key for s in live for m in s.media if m.features is None}
        for key in [k for k in self.jobs if k not in needed]:  # its requests failed or were aborted
            del self.jobs[key]
        order = sorted(live, key=lambda s: self._served.get(s.request_id, -1))  # stable: then arrival
        slices, served = pack([(s, [self.jobs[m.key] for m in s.media if m.key in self.jobs]) for s in order],
                              self.token_budget)
        for seq in served:
            self._served[seq.request_id] = self._steps
            seq.timings.setdefault("encode_start", time.time())
        if slices:
            self._encode(slices)
        ready = [s for s in live if all(m.features is not None for m in s.media)]
        for seq in ready + [s for s, _ in failed]:
            self.remove(seq)
            seq.timings["encode_end"] = time.time()
        return ready, failed

    def _job(self, m: MediaItem) -> EncodeJob:
        t = int(m.grid_thw.reshape(3)[0])
        return EncodeJob(m, self.adapter.tokens_per_image(m.grid_thw) // t,
                         sliceable=self.adapter.config.model_type in TEMPORAL_SLICING_EXACT)

    def _from_provider(self, m: MediaItem) -> bool:
        if self.encodes and not self.prefills:
            if self.features.contains(m.key):  # E-only: the store has it, nothing to move
                m.features, m.from_store = [], True
                return True
            return False
        feats = self.features.load(m.key, 0.0)
        if feats is None or len(feats) != 1 + self.adapter.num_deepstack:
            return False
        m.features, m.from_store = feats, True
        return True

    def _encode(self, slices: list[Slice]) -> None:
        t0 = time.perf_counter()
        inputs = [s.job.slice_input(s.start, s.end) for s in slices]
        with self.gate.hold("E"):
            feats = self.adapter.encode_images([pv for pv, _ in inputs], [g for _, g in inputs])
        self.encoder_calls += 1
        done = []
        for s, f in zip(slices, feats):
            s.job.add_part(f, s.end - s.start)
            if s.job.complete:
                done.append(s.job)
        self.stats.record_vision(len(done), time.perf_counter() - t0)
        self.encoder_runs += len(done)
        if not self.encodes:
            self.recomputes += len(done)
        for job in done:
            key, f = job.item.key, job.features()
            del self.jobs[key]
            owners = [s for s in self.pending if any(m.key == key and m.features is None for m in s.media)]
            if self.encodes:
                self.features.save(key, f, request_id=owners[0].request_id, target=owners[0].feature_target)
            for seq in owners:  # the same media in every pending request
                for m in seq.media:
                    if m.key == key and m.features is None:
                        m.features = f
