"""The configurations `epdserve bench offline` compares, each a function over the same requests.

Owns one runner per configuration — the epdserve engine (`LLM.generate`, all requests at once),
transformers `generate` one request at a time, `generate` on left-padded batches, and
transformers' continuous batching (`generate_batch`, token ids only) — and `CONFIGS`, the
registry the worker process looks names up in. Every runner gets the requests and the output
length, times only the generation (input preprocessing included, model loading excluded), and
returns a `RunResult` with every request's output token ids. EOS never stops a request:
the engine uses `ignore_eos`, transformers gets `eos_token_id=-1` (nothing suppressed either,
so greedy tokens stay comparable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from epdserve.bench.offline_workloads import BenchRequest


@dataclass
class RunResult:
    tokens: list[list[int]]  # output token ids per request, in request order
    duration_s: float  # wall time of the timed generation
    prompt_tokens: int  # input tokens, vision tokens included
    vision_tokens: int
    extra: dict = field(default_factory=dict)
    cpu_s: float = 0.0  # process CPU time (all threads) over the same span; > threads × wall means oversubscribed


class Stopwatch:
    """Wall and process CPU time of a `with` block."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


@dataclass
class RunContext:
    """What a runner needs besides the requests: loaded on demand, once per worker process."""

    model_dir: str
    engine_args: dict = field(default_factory=dict)
    padded_batch_size: int = 8
    cb_page_size: int = 32
    cb_max_batch_tokens: int = 2048


# ---------------------------------------------------------------- epdserve engine
def run_engine(ctx: RunContext, requests: list[BenchRequest], output_len: int, warmup: BenchRequest) -> RunResult:
    from epdserve import LLM, SamplingParams

    llm = LLM(model=ctx.model_dir, device="cpu", **ctx.engine_args)
    llm.generate([warmup.as_llm_prompt()], SamplingParams(max_tokens=2, ignore_eos=True))
    before = llm.engine.stats.as_dict()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    with Stopwatch() as sw:
        outs = llm.generate([r.as_llm_prompt() for r in requests], params)
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} engine request(s) failed, first: {failed[0]}")
    after = llm.engine.stats.as_dict()
    split = {k: after[k] - before[k] for k in after}
    return RunResult(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        duration_s=sw.wall,
        cpu_s=sw.cpu,
        prompt_tokens=sum(o.num_prompt_tokens for o in outs),
        vision_tokens=sum(o.num_vision_tokens for o in outs),
        extra={"engine_stats": split, "engine_args": dict(ctx.engine_args)},
    )


def run_engine_portable(ctx: RunContext, requests: list[BenchRequest], output_len: int,
                        warmup: BenchRequest) -> RunResult:
    """The same engine on the portable paged operators (gather + SDPA) instead of the native ones."""
    portable = RunContext(ctx.model_dir, {**ctx.engine_args, "ops": "portable"}, ctx.padded_batch_size,
                          ctx.cb_page_size, ctx.cb_max_batch_tokens)
    return run_engine(portable, requests, output_len, warmup)


# ---------------------------------------------------------------- transformers generate
class _HF:
    """A transformers model plus epdserve's processor, so inputs match the engine's exactly."""

    def __init__(self, ctx: RunContext):
        from epdserve.model.loader import load_checkpoint, max_model_len
        from epdserve.model.processor import MultimodalProcessor

        ckpt = load_checkpoint(ctx.model_dir, "cpu", torch.float32)
        self.model = ckpt.model
        cfg = self.model.config
        self.image_token_id = cfg.image_token_id
        self.pad_id = ckpt.tokenizer.pad_token_id
        self.processor = MultimodalProcessor(
            ckpt.tokenizer, ckpt.image_processor, cfg.image_token_id, cfg.vision_config.spatial_merge_size,
            max_model_len(cfg.text_config),
        )

    def gen_config(self, output_len: int):
        from transformers import GenerationConfig

        return GenerationConfig(do_sample=False, max_new_tokens=output_len, eos_token_id=-1, pad_token_id=self.pad_id)

    def inputs(self, requests: list[BenchRequest]) -> tuple[dict, list[int], int]:
        """Left-padded `generate` kwargs for a batch; also each prompt's length and its vision tokens."""
        processed = [self.processor.process(r.prompt, r.images) for r in requests]
        width = max(len(p.token_ids) for p in processed)
        ids = torch.full((len(processed), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(processed):
            ids[row, width - len(p.token_ids):] = torch.tensor(p.token_ids)
            mask[row, width - len(p.token_ids):] = 1
        kwargs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == self.image_token_id).int()}
        media = [m for p in processed for m in p.media]
        if media:
            kwargs["pixel_values"] = torch.cat([m.pixel_values for m in media])
            kwargs["image_grid_thw"] = torch.stack([m.grid_thw.reshape(3) for m in media])
        lengths = [len(p.token_ids) for p in processed]
        return kwargs, lengths, sum(m.num_tokens for m in media)

    @torch.inference_mode()
    def generate(self, requests: list[BenchRequest], output_len: int) -> tuple[list[list[int]], int, int]:
        kwargs, lengths, vision = self.inputs(requests)
        out = self.model.generate(**kwargs, generation_config=self.gen_config(output_len))
        new = out[:, kwargs["input_ids"].shape[1]:].tolist()
        if any(len(t) != output_len for t in new):
            raise RuntimeError(f"generate returned {[len(t) for t in new]} tokens, expected {output_len} each")
        return new, sum(lengths), vision


def _run_generate(ctx: RunContext, requests, output_len, warmup, batch_size: int) -> RunResult:
    hf = _HF(ctx)
    hf.generate([warmup], 2)
    tokens, prompt_tokens, vision_tokens = [], 0, 0
    with Stopwatch() as sw:
        for i in range(0, len(requests), batch_size):
            new, p, v = hf.generate(requests[i : i + batch_size], output_len)
            tokens.extend(new)
            prompt_tokens += p
            vision_tokens += v
    return RunResult(tokens, sw.wall, prompt_tokens, vision_tokens, extra={"batch_size": batch_size}, cpu_s=sw.cpu)


def run_one_at_a_time(ctx: RunContext, requests, output_len, warmup) -> RunResult:
    return _run_generate(ctx, requests, output_len, warmup, batch_size=1)


def run_padded(ctx: RunContext, requests, output_len, warmup) -> RunResult:
    """Batches in arrival order (no sorting by length), left-padded to the longest prompt."""
    return _run_generate(ctx, requests, output_len, warmup, batch_size=ctx.padded_batch_size)


# ---------------------------------------------------------------- transformers continuous batching
def cb_sizes(prompt_lens: list[int], output_len: int, page_size: int, max_batch_tokens: int) -> dict:
    """Explicit `ContinuousBatchingConfig` sizes: room for every request at once, nothing more."""
    pages = sum(-(-(n + output_len) // page_size) for n in prompt_lens)
    return {"num_blocks": pages + 8, "page_size": page_size, "max_batch_tokens": max_batch_tokens}


def run_generate_batch(ctx: RunContext, requests, output_len, warmup) -> RunResult:
    """`model.generate_batch` on token ids; text-only (it takes no pixels and no M-RoPE positions)."""
    from transformers import ContinuousBatchingConfig

    if any(r.images for r in requests):
        raise ValueError("generate_batch takes token ids only: text-only workloads")
    hf = _HF(ctx)
    gen = hf.gen_config(output_len)

    def batch(reqs, n_out):
        ids = [hf.processor.process(r.prompt).token_ids for r in reqs]
        sizes = cb_sizes([len(x) for x in ids], n_out, ctx.cb_page_size, ctx.cb_max_batch_tokens)
        gen.max_new_tokens = n_out
        out = hf.model.generate_batch(
            inputs=ids, generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**sizes),
            progress_bar=False,
        )
        return ids, list(out.values()), sizes

    batch([warmup], 2)
    with Stopwatch() as sw:
        ids, results, sizes = batch(requests, output_len)
    tokens = [list(r.generated_tokens) for r in results]
    if len(tokens) != len(requests) or any(len(t) != output_len for t in tokens):
        raise RuntimeError(f"generate_batch returned {len(tokens)} results, lengths {sorted({len(t) for t in tokens})}")
    return RunResult(tokens, sw.wall, sum(len(x) for x in ids), 0, extra={"continuous_batching_config": sizes},
                     cpu_s=sw.cpu)


CONFIGS = {
    "engine": run_engine,
    "engine_portable": run_engine_portable,
    "one_at_a_time": run_one_at_a_time,
    "padded": run_padded,
    "generate_batch": run_generate_batch,
}
LABELS = {
    "engine": "epdserve engine (LLM.generate, all at once)",
    "engine_portable": "epdserve engine, portable paged ops (gather + SDPA)",
    "one_at_a_time": "transformers generate, 1 request at a time",
    "padded": "transformers generate, left-padded batches of 8",
    "generate_batch": "transformers generate_batch (continuous batching)",
}
