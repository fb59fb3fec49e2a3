"""Encode stage: gets every media item of a request its features, then hands the request on.

Per media item, in order of preference:
1. the `FeatureProvider` already has it (local cache, or the MM Store filled by an E instance):
   an encode-role engine only checks that it exists; a prefill-side engine loads it;
2. this engine encodes it (its role includes E) and saves it to the provider;
3. a prefill-only engine waits up to `wait_s` (polled each step, never blocking the loop) for
   the feature to arrive, then recomputes it with its own vision encoder — same output,
   counted in `recomputes`. An item without raw media cannot be recomputed: that request fails.
   An item whose bytes came undecoded (`MediaItem.load_input`: the features were expected in the
   store) is decoded only now, when it must be recomputed.
Encoding runs under a vision-token budget per engine step, across requests, round-robin over
tenants and, within a tenant, over its requests (with
`encode_per_item`, an encode-only engine takes one item of a request per call, so each is stored
and announced as soon as it is done, for pipelined prefill); a
video over the budget is encoded a few temporal patches per step (engine/encode_plan.py), and
its features are stored once, whole, when its last slice is done. While requests decode, the
engine's step-time budget may also cut one encoder call at its vision blocks: a `SlicedEncode`
runs a few blocks per step, its hidden state carried (model/vision_stages.py, the same features
bit for bit), and dropped when every request it encoded for is gone.
An item's features are one list (the embedding, then Qwen3-VL's DeepStack features): a stored
value with another number of tensors is treated as absent, so it is recomputed.
"""
from __future__ import annotations

import time

from dataclasses import dataclass
from typing import Callable

from epdserve.engine.encode_plan import TEMPORAL_SLICING_EXACT, EncodeJob, Slice, pack
from epdserve.engine.request_parts import MediaItem
from epdserve.engine.sequence import RequestState, Sequence
from epdserve.engine.stats import EngineStats
from epdserve.engine.step_budget import StepBudget
from epdserve.model.adapter import VLMAdapter
from epdserve.model.vision_stages import VisionRun, sliceable
from epdserve.seams.feature_provider import FeatureProvider


@dataclass(eq=False)
class SlicedEncode:
    """An encoder call run a few vision blocks per step (the step-time budget's share)."""

    run: VisionRun
    slices: list[Slice]
    seconds: float  # spent on it so far


class EncodeStage:
    def __init__(self, adapter: VLMAdapter, features: FeatureProvider, *, encodes: bool, prefills: bool,
                 wait_s: float, token_budget: int, stats: EngineStats, budget: StepBudget | None = None,
                 per_item: bool = False):
        self.adapter = adapter
        self.features = features
        self.encodes = encodes
        self.prefills = prefills
        self.wait_s = wait_s
        self.token_budget = token_budget
        self.per_item = per_item  # one item of a request per encoder call: each stored as soon as it is done
        self.stats = stats
        self.pending: list[Sequence] = []
        self.jobs: dict[str, EncodeJob] = {}  # media key -> its encoding in progress
        self._served: dict[str, int] = {}  # request id -> the last step that encoded a slice of it
        self._tenant_served: dict[str, int] = {}  # tenant -> the last step that encoded for it
        self._steps = 0
        self.recomputes = 0
        self.encoder_runs = 0  # media items encoded (whole, however many slices)
        self.encoder_calls = 0  # vision tower calls
        self.budget = budget  # the engine's step-time budget: measured vision costs go to it
        self._run: SlicedEncode | None = None  # an encoder call in flight across steps
        # one whole encoder call; a tensor-parallel instance spreads it over its ranks (engine/tp/encode_dp.py)
        self.encode: Callable[[list, list], list[list]] = adapter.encode_images

    def oldest_arrival(self) -> float:
        """Arrival order of the oldest request waiting for its media (inf: none)."""
        return min((s.arrival for s in self.pending), default=float("inf"))

    def add(self, seq: Sequence) -> None:
        seq.state = RequestState.WAITING_FOR_FEATURES
        self.pending.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.pending:
            self.pending.remove(seq)
            self._served.pop(seq.request_id, None)
            self._prune(self.pending)

    def _prune(self, live: list[Sequence]) -> None:
        """Drop the encodes no `live` request waits for (failed or aborted), and with them an
        encoder call in flight that no longer serves anyone (its carried state goes)."""
        needed = {m.key for s in live for m in s.media if m.features is None}
        for key in [k for k in self.jobs if k not in needed]:
            del self.jobs[key]
        if self._run is not None and not any(self.jobs.get(x.job.item.key) is x.job for x in self._run.slices):
            self._run = None

    def step(self, vision_blocks: Callable[[int], int | None] | None = None
             ) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """Advance every pending request; returns (ready requests, failed (request, message)).
        `vision_blocks(patches)`: how many vision-tower blocks this step may run of an encode
        over that many patches (None: all); without it every encode runs whole."""
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
                if m.input is None and m.load_input is not None:
                    try:  # its bytes came undecoded (the features were expected in the store)
                        m.input = m.load_input()
                    except Exception as e:  # noqa: BLE001 - the scheduler decoded them once already
                        failed.append((seq, f"media {m.key}: cannot decode its bytes to recompute it: {e}"))
                        break
                if m.input is None:
                    failed.append((seq, f"features of media {m.key} are not in the store and its bytes were not sent"))
                    break
                self.jobs[m.key] = self._job(m)
        bad = {id(s) for s, _ in failed}
        live = [s for s in self.pending if id(s) not in bad]
        self._prune(live)
        if self._run is not None:
            self._advance(vision_blocks)
        else:
            # round-robin over tenants, then over each tenant's requests (stable: then arrival)
            order = sorted(live, key=lambda s: (self._tenant_served.get(s.tenant.name, -1), self._served.get(s.request_id, -1)))
            slices, served = pack([(s, [self.jobs[m.key] for m in s.media if m.key in self.jobs]) for s in order],
                                  self.token_budget, 1 if self.per_item else None)
            for seq in served:
                self._served[seq.request_id] = self._tenant_served[seq.tenant.name] = self._steps
                seq.timings.setdefault("encode_start", time.time())
            if slices:
                self._start(slices, vision_blocks)
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

    def _start(self, slices: list[Slice], vision_blocks: Callable[[int], int | None] | None) -> None:
        """One encoder call over `slices`: whole, or a `SlicedEncode` advanced block by block."""
        inputs = [s.job.slice_input(s.start, s.end) for s in slices]
        patches = sum(int(pv.shape[0]) for pv, _ in inputs)
        blocks = vision_blocks(patches) if vision_blocks is not None else None
        if blocks is None or not sliceable(self.adapter.config.model_type):
            t0 = time.perf_counter()
            feats = self.encode([pv for pv, _ in inputs], [g for _, g in inputs])
            seconds = time.perf_counter() - t0
            self._record_vision(patches, len(self.adapter.vision_tower.blocks), seconds)
            self._finish(slices, feats, seconds)
            return
        t0 = time.perf_counter()
        run = VisionRun(self.adapter, [pv for pv, _ in inputs], [g for _, g in inputs])
        self._run = SlicedEncode(run, slices, time.perf_counter() - t0)
        self._advance(lambda _: blocks)

    def _advance(self, vision_blocks: Callable[[int], int | None] | None) -> None:
        """Run the in-flight encode's next blocks; finished, hand out its features."""
        enc = self._run
        blocks = vision_blocks(enc.run.num_patches) if vision_blocks is not None else None
        if blocks == 0:  # the budget has no room this step
            return
        t0 = time.perf_counter()
        ran = enc.run.run(blocks if blocks is not None else enc.run.num_blocks)
        seconds = time.perf_counter() - t0
        self._record_vision(enc.run.num_patches, ran, seconds)
        feats = enc.run.finish() if enc.run.done else None
        enc.seconds += time.perf_counter() - t0
        if feats is not None:
            self._run = None
            self._finish(enc.slices, feats, enc.seconds)

    def _record_vision(self, patches: int, blocks: int, seconds: float) -> None:
        if self.budget is not None:
            self.budget.record_vision(patches, blocks, seconds)

    def _finish(self, slices: list[Slice], feats: list[list], seconds: float) -> None:
        """One encoder call's features to their jobs (a job aborted meanwhile is skipped)."""
        self.encoder_calls += 1
        done = []
        for s, f in zip(slices, feats):
            if self.jobs.get(s.job.item.key) is not s.job:
                continue
            s.job.add_part(f, s.end - s.start)
            if s.job.complete:
                done.append(s.job)
        self.stats.record_vision(len(done), seconds)
        self.encoder_runs += len(done)
        if not self.encodes:
            self.recomputes += len(done)
        for job in done:
            key, f = job.item.key, job.features()
            del self.jobs[key]
            owners = [s for s in self.pending if any(m.key == key and m.features is None for m in s.media)]
            if self.encodes:
                self.features.save(key, f, request_id=owners[0].request_id, target=owners[0].handoff.feature_target)
            for seq in owners:  # the same media in every pending request
                for m in seq.media:
                    if m.key == key and m.features is None:
                        m.features = f
