"""`EngineConfig`: everything that shapes one engine, validated on construction.

Its `setting(...)` fields are the engine's flags: the instance declares them `same_as` these
(epdserve/settings.py), so each has one default, one help text and one unit conversion.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.engine.step_budget import BANK, HORIZON
from epdserve.roles import RoleSet, normalize_roles, role_set
from epdserve.settings import check_settings, read_env, same_as, setting
from epdserve.slo import SLO


@dataclass
class EngineConfig:
    """roles: which stages this engine runs, a name of `epdserve/roles.py`'s table ("EPD" = the whole
    pipeline in one step loop; "P+E" = prefill encoding inline)."""

    model: str = setting(help="checkpoint directory", required=True)
    device: str = setting("auto", help="cpu | cuda[:N] | npu[:N] | auto (an NPU, else a CUDA GPU, else the CPU)")
    dtype: str | None = setting(
        None, choices=("auto", "float32", "float16", "bfloat16"), env="EPDSERVE_DTYPE",
        help="weights, activations and the KV cache (not set: $EPDSERVE_DTYPE, else auto). auto: bf16 on an "
             "accelerator and on a CPU with AVX512-BF16 or AMX-BF16 (on this project's CPU it decoded 2.9x faster "
             "than fp32 at batch 1 and 3.2x at batch 32, README 'Decode speed'), fp32 on other CPUs "
             "(platform/dtype_default.py); the instance's ready line says which and why. float32 is the exactness "
             "oracle: greedy outputs equal transformers' fp32 generate (bf16's follow its bf16 generate). launch "
             "resolves auto once and gives every instance the same dtype; a P and a D that differ are refused at "
             "registration")
    roles: str = "EPD"
    block_size: int | None = setting(
        None, check=(">=", 1),
        help="tokens per KV block (default: the platform's: 16 on CPU/CUDA, 128 on NPU, as its kernels want)")
    kv_cache_bytes: int = setting(1 << 30, help="KV cache size per P/D worker (MiB)", flag="--kv-cache-mb",
                                  check=(">=", 1), to_field=lambda mb: mb << 20, from_field=lambda b: b >> 20)
    max_num_seqs: int = setting(128, check=(">=", 1), help="requests one engine runs at once")
    scheduling_policy: str = setting(
        "fair", choices=("fair", "fcfs"),
        help="which waiting request the engine admits next when it is full: fair — the tenant holding the least "
             "weighted share of the running sequences first (the keys file's @weight; a tenant alone is served in "
             "arrival order), and a preemption takes the newest request of the tenant holding the most "
             "(engine/fair_share.py); compiles of new structured-output grammars and media encodes take turns by "
             "tenant too. fcfs — arrival order everywhere in the engine, whoever sent it (vLLM's fcfs)")
    max_num_batched_tokens: int = setting(
        2048, check=(">=", 1), help="tokens one engine step schedules, prefill chunks and decodes together")
    max_model_len: int | None = setting(None, check=(">=", 1), help="longest prompt + output (default: the model's)")
    encode_token_budget: int = setting(
        1024, check=(">=", 1),
        help="E: vision tokens (after the spatial merge) encoded per engine step, across requests, least recently "
             "served request first, so a many-image request or a long video does not hold E while others wait; a "
             "video over it is encoded a few temporal patches per step (exact for Qwen2-VL / Qwen2.5-VL / Qwen3-VL; "
             "other models encode each item whole), an image alone over it in a step of its own")
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = setting(
        True, negate="--no-prefix-caching",
        help="no prefix cache: every prompt is prefilled from its first token (default: full KV blocks of "
             "finished and running requests are kept, keyed by their tokens and media, and a prompt that starts "
             "the same way reuses them; media wholly inside a reused prefix are neither encoded nor fetched)")
    # the step budget is tied to the TPOT objective: one setting, one default (epdserve/slo.py)
    slo_tpot_ms: float = same_as(
        SLO, "tpot_ms",
        help="the TPOT SLO, ms: while requests decode, each engine step takes only the prefill chunk and the "
             "vision-encoder blocks that fit beside its decodes, from costs measured online, so that every "
             "decoding request keeps to 0.9x this per token on average over its next --step-budget-horizon tokens "
             "(time its short steps save may be spent by one long step; engine/step_budget.py); the scheduler's controller and "
             "`bench serve` count against the same objective")
    step_budget_bank: float = setting(
        BANK, check=(">=", 1),
        help="the most targets (0.9x --slo-tpot-ms each) one budgeted step may take when its decoding requests "
             "have that much slack (engine/step_budget.py): 32 (default) sets no cap below what a full "
             "--step-budget-horizon can bank, so an engine whose decodes can afford it runs an arriving image's "
             "encode and prefill whole; 2 keeps every gap between two tokens near 1.8x the SLO at most (more, "
             "shorter-stretched gaps: measured 2.7x the median gap under a steady load here)")
    step_budget_horizon: int = setting(
        HORIZON, check=(">=", 1),
        help="tokens ahead a decoding request's slack is counted over (its remaining tokens if fewer): a "
             "budgeted step may take what keeps that token on time if the steps after it decode only "
             "(engine/step_budget.py); 32 (default, measured best here) spends the TPOT SLO as the mean it is; "
             "1 keeps every step to the next token's due time")
    step_budget: bool = setting(
        True, negate="--no-step-budget",
        help="no step-time budget: a step runs a whole encode and prefill chunks up to --max-num-batched-tokens "
             "while requests decode (their TPOT then stalls behind them)")
    # read only by an engine that prefills without encoding (a P whose E is another instance): 0 would
    # recompute every item whose features have not landed yet, throwing E's work away
    feature_wait_s: float = setting(
        5.0, check=(">=", 0), help="P: wait this long for E's features, then recompute them itself")
    pipelined_prefill: bool = setting(
        True, negate="--no-pipelined-prefill",
        help="P waits for every media item's features before it prefills a prompt (default: it prefills the "
             "prompt in order up to the first item whose features have not arrived, and goes on as each item "
             "lands; engine/pipelined_prefill.py)")
    encode_per_item: bool = setting(
        False, help="E: encode one media item of a request per encoder call, so that each is stored and its "
                    "prefill side told as soon as it is done (more overlap for pipelined prefill; fewer batched "
                    "items per call; default off: no reliable win on this project's 2-core CPU, "
                    "docs/uploads-and-pipelining.md)")
    enforce_eager: bool = setting(
        False, help="run every step eagerly: no captured decode graphs (CUDA and the NPU capture one per "
                    "batch-size bucket at start-up, check one replayed step against eager, and replay them for "
                    "each decode-only step; the CPU, and an NPU whose torch_npu lacks the graph-task API, always "
                    "run eagerly)")
    tensor_parallel_size: int = setting(
        1, check=(">=", 1),
        help="ranks the language model is split over, one process and one device each (rank r on the device "
             "index after --device's plus r; all on the CPU there): each rank holds its share of the attention "
             "heads and MLP columns (a MoE model's experts: expert parallelism) and its KV heads' cache, rank 0 "
             "schedules, encodes media and samples (engine/tp/). Must divide the attention heads, the MLP width and "
             "the experts, and divide the KV heads or be a multiple of them (start-up names the valid degrees); a "
             "disaggregated P or D at any degree sends or receives each rank's own KV heads (docs/tensor-parallel.md)")
    quantization: str | None = setting(
        None, choices=("int8", "w8a8", "int4", "ascend", "fp8", "compressed-tensors"),
        help="the language model's attention and MLP weights, MoE experts included (int8, w8a8, int4, fp8: each expert "
             "on its own), quantized at load from the checkpoint's "
             "(CPU; int8, w8a8 and int4 also on an Ascend NPU; int8, int4 and fp8 also on CUDA, int8 and int4 there on Triton "
             "kernels checked on the device at start-up): int8 = int8 per output channel, weight-only, activations and "
             "KV in --dtype (W8A16: on the CPU faster "
             "than bf16 at a decode batch of a few sequences, slower above; engine/lm/quant_linear.py); w8a8 = each "
             "token's activations quantized to int8 too (as fast as bf16 or faster at decode batches up to 32 here, "
             "slower in prefill; its outputs stray further from the unquantized model's); int4 = 4-bit weights in "
             "groups of 128 inputs with a scale and zero each (W4A16, about a quarter of the bf16 bytes; "
             "engine/lm/int4_linear.py; a TP rank's share of a row-parallel projection, and a MoE model's expert widths, "
             "must be whole groups); fp8 = "
             "float8_e4m3fn weights, one scale a projection, and each token's activations in fp8, one "
             "torch._scaled_mm (CPU, and CUDA of compute capability >= 8.9; engine/lm/fp8_linear.py; a MoE expert one "
             "scale for its gate-up and one for its down). The vision encoder, embedding, LM head and MoE router stay in --dtype. An msModelSlim checkpoint "
             "(quant_model_description.json: W8A8_DYNAMIC, W8A8 static, W8A16) runs as it was quantized without this "
             "flag; ascend (vLLM's name) asks for exactly that and is refused for any other checkpoint. Likewise a "
             "compressed-tensors FP8 checkpoint (config.json quantization_config: llm-compressor's W8A8-FP8, per-tensor "
             "or per-channel weights; engine/lm/fp8_checkpoint.py) runs as compressed-tensors (vLLM's name), and a block-wise FP8 checkpoint (quant_method fp8, "
             "weight_block_size: Qwen's own) as fp8; either's MoE experts, stored one module each (mlp.experts.<e>.*), "
             "run in FP8 at any tensor_parallel_size (engine/lm/per_expert.py). A P and a D "
             "must use the same method (checked at registration)")
    grammar_cache_bytes: int = setting(
        512 << 20, flag="--grammar-cache-mb", check=(">=", 1), to_field=lambda mb: mb << 20,
        from_field=lambda b: b >> 20,
        help="compiled structured-output grammars an engine keeps (MiB, by xgrammar's own measure of each; least "
             "recently used evicted first): a flood of big schemas evicts older grammars instead of growing the cache")
    max_grammar_bytes: int = setting(
        64 << 20, flag="--max-grammar-mb", check=(">=", 1), to_field=lambda mb: mb << 20,
        from_field=lambda b: b >> 20,
        help="largest compiled grammar one request's structured output may take (MiB); over it the request fails "
             "alone with INVALID_ARGUMENT / 400 naming this limit, and nothing is cached (a 20,000-value enum "
             "compiles to ~62 MiB on the small demo model's vocabulary)")
    grammar_compile_timeout_s: float = setting(
        10.0, check=(">=", 0),
        help="longest a structured output's grammar may compile (s): compiles run in a child process of the "
             "engine's, which is killed past this (its CPU and memory freed) and the request fails alone with "
             "INVALID_ARGUMENT / 400 naming this limit, nothing cached. 0: compile on a thread of the engine "
             "process, unbounded (a schema of a 60,000-value enum took 18-30 s and 230-450 MB here)")
    seed: int = 0
    ops: str | None = setting(
        None, choices=("native", "portable"), env="EPDSERVE_OPS",
        help="paged and LM-layer operators: native (csrc/) or portable (torch); not set: $EPDSERVE_OPS, else the "
             "platform's best (ops/select.py)")

    def __post_init__(self):
        self.roles = normalize_roles(self.roles)
        if self.slo_tpot_ms is None:
            raise ValueError("slo_tpot_ms must be set: the step budget counts against it")
        read_env(self)  # ops not given: $EPDSERVE_OPS
        check_settings(self)  # the bounds and choices declared on the fields

    @property
    def role_set(self) -> RoleSet:
        return role_set(self.roles)

    @property
    def encodes(self) -> bool:
        return self.role_set.encodes

    @property
    def prefills(self) -> bool:
        return self.role_set.prefills

    @property
    def decodes(self) -> bool:
        return self.role_set.decodes

    @property
    def computes(self) -> bool:
        """Runs the language model (P or D): holds request KV, schedules tokens."""
        return self.prefills or self.decodes
