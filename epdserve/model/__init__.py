"""epdserve.model: a Hugging Face Qwen-VL checkpoint as the engine uses it, and its inputs.

Owns offline loading, the vision / language-model split, prompt + media processing, chat
rendering, the demo checkpoints and the transformers reference. The errors its inputs raise are
`epdserve.request_errors` (below every layer that raises or maps them).

- loader.py          a checkpoint directory, offline: model, tokenizer, image processor, context length
- adapter.py         VLMAdapter: the vision encoder and the language model of one HF model
- vision_stages.py   VisionRun: one vision-tower forward run a few blocks at a time (the same features)
- deepstack.py       Qwen3-VL DeepStack: which rows of a prompt chunk get which visual features
- processor.py       MultimodalProcessor: prompt + images (+ videos) → token ids with expanded placeholders
- video.py           video input: decode (PyAV), sample frames, resize, normalize, patch
- chat.py            chat messages (OpenAI shape) → one prompt and its media, in order
- tool_calls.py      tool calls in the Qwen (Hermes) format: the prompt's tools section, <tool_call> blocks parsed
- reference.py       ReferenceGenerator: transformers' own `generate`, the correctness oracle
- demo.py            random-weight demo checkpoints laid out like downloaded Qwen-VL ones
- demo_cache.py      the demo checkpoints in the user's cache, built once (launch's default model)
- demo_qwen3.py      the Qwen3-VL / Qwen3-VL-MoE shapes of the demo checkpoints
- demo_tokenizer.py  an offline Qwen2-VL style tokenizer for the demo checkpoints
- demo_images.py     procedural test images for demos, tests and benchmarks
"""
