"""epdserve.engine: one engine — request states, scheduler + block manager, model runner, sampler.

It reaches other instances only through epdserve.seams (the `KVConnector` and the
`FeatureProvider` it is given at construction); it never imports transfer/.

- llm_engine.py      LLMEngine: the public API (build_request, add_request, step, abort, load_report)
- engine_request.py  EngineRequest: the one intake type for every role
- loaded_model.py    LoadedModel: a checkpoint loaded once per process, shared by its engines
- scheduler.py       Scheduler: queues, request states, the block manager's only owner; schedule / update
- encode_stage.py    EncodeStage: media features from the FeatureProvider or the vision tower
- encode_plan.py     encode batching under a vision-token budget: round-robin, videos by temporal patches
- grammar.py         structured outputs: xgrammar grammars compiled once per schema, one matcher per request, the token mask
- grammar_compile.py new grammars compiled off the engine's loop, queued per tenant (the request waits, the others go on)
- grammar_process.py the child process a compile runs in, killed past its time budget
- structured_output.py  StructuredOutput: the constraint a request's output follows (part of SamplingParams)
- pipelined_prefill.py  per-item E->P pipelining: prefill up to the first media item whose features are missing
- step_budget.py     StepBudget: the prefill chunk and vision blocks a step may add beside its decodes (TPOT SLO)
- step_contract.py   the step contract: ScheduledStep (frozen rows + block copies) from schedule(), StepResult from execute()
- model_runner.py    ModelRunner: execute(step) — one packed forward over a scheduled batch, then sampling
- forward_inputs.py  ForwardInputs: one forward's host inputs (what rank 0 sends the other TP ranks)
- tp/                tensor parallelism inside an instance: the shard map, the rank processes, the group
- tp_rank.py         a tensor-parallel rank other than 0 (its own process): the same forwards, its share of encodes
- lm/                LeanLM: the fused LM forward (weights, rotary tables, the layer loop)
- step_buffers.py    StepBuffers: pinned host / device buffers, one upload a step
- graph_runner.py    DecodeGraphs: decode steps replayed from captured graphs (CUDA, NPU)
- graph_check.py     the start-up self-check: one replayed decode step against eager, graphs off on a difference
- sequence.py        Sequence and RequestState: one request inside the engine
- request_parts.py  the records a Sequence is made of: MediaItem, Emitted, PrefixMemo, Handoff, TenantShare, ChoiceGroup, PipelineState
- turns.py           Turns: whose turn is next among tenants (the one served least recently)
- fair_share.py      which waiting request is admitted next, and which running one preempted, by tenants' weighted shares
- sequence_group.py  n > 1: the prompt prefilled once, the choices forked at the first token sharing its KV blocks
- prefix_hash.py     PrefixHasher: chained hashes of full KV blocks keyed by tokens and media identity
- logits_process.py logit_bias and the repetition / frequency / presence penalties on the sampling rows
- logprobs.py        TokenLogprob: raw log probabilities of sampled tokens and their top alternatives
- block_manager.py, kv_cache.py, sampler.py, stop_checker.py, outputs.py, stats.py, config.py,
  sampling_params.py: the parts those use (what a role set means: epdserve/roles.py)
"""
