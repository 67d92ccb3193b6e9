"""Help text of every engine flag (`keel serve/generate/bench/profile show --help`), by EngineArgs field.

`EngineArgs.add_cli_args` appends the effective default (the built-in one of the field's config
section, which a profile may override); a test fails if a field has no entry here.
"""

from __future__ import annotations

HELP: dict[str, str] = {
    "model": "model directory (config.json, safetensors, tokenizer), Hugging Face repo id, or 'demo' "
             "(a tiny local model with random weights)",
    "tokenizer": "tokenizer directory or repo id",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, float16/half, bfloat16",
    "seed": "engine random seed (requests without their own seed draw from it)",
    "block_size": "tokens per KV cache block",
    "max_model_len": "context length (prompt + output); takes 8k (8000), 8K (8192), 1m, 1M as vLLM does",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "token budget of one step",
    "enable_prefix_caching": "reuse KV blocks of earlier requests with the same prefix",
    "enable_chunked_prefill": "split long prompts over steps within the token budget",
    "async_scheduling": "schedule step N+1 while the device runs step N",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs carry no text",
    "attention_backend": "attention backend key (see `keel plugins list`)",
    "kv_cache_memory_bytes": "KV cache budget in bytes (4GiB, 512MB, ...)",
    "num_kv_blocks": "explicit number of KV cache blocks (overrides both budgets)",
    "gpu_memory_utilization": "share of device memory the engine may use, in (0, 1]",
    "enforce_eager": "never capture CUDA graphs",
    "platform": "platform key (cpu, cuda, ...) or auto: the highest-priority available one",
    "plugins": "plugins to load, comma-separated entry-point names, or auto (every installed one)",
    "profile": "profile name (profiles/NAME.yaml) or path to a YAML profile",
    "tensor_parallel_size": "tensor-parallel ranks",
    "pipeline_parallel_size": "pipeline-parallel stages",
    "data_parallel_size": "data-parallel replicas (a scheduler and KV cache each; with --enable-expert-parallel, "
                          "attention DP and the MoE experts EP over the same ranks)",
    "enable_expert_parallel": "shard MoE experts over the tensor-parallel ranks",
    "distributed_executor_backend": "executor driving the workers: uni, mp, ray (auto: uni for one rank, "
                                    "else mp)",
    "engine_core_process": "run the server's engine core in its own process",
    "engine_iteration_timeout_s": "the server's step watchdog in seconds (0: off)",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 3}'",
    "trust_remote_code": "allow the checkpoint's own Python code (transformers' trust_remote_code)",
    "revision": "model revision (branch, tag or commit) on the Hub",
    "served_model_name": "the model name the API answers to (one name)",
    "load_format": "auto (the checkpoint's weights) or dummy (random weights, for benchmarks)",
    "generation_config": "auto (the model's generation_config.json), vllm (ignore it) or a folder holding "
                         "one",
    "quantization": "quantization method (fp8, gptq, awq, compressed-tensors); default: the checkpoint's",
    "kv_cache_dtype": "KV cache storage dtype: auto (the model's), fp8 / fp8_e4m3",
    "scheduling_policy": "fcfs, or priority: waiting requests by their `priority` (lower first), then arrival",
    "logits_processors": "batch-level logits processors: logits_processor plugin keys or pkg.module:Class names",
    "max_logprobs": "most logprobs (and prompt_logprobs) a request may ask for; -1: the vocabulary size",
    "disable_shared_experts_fusion": "MoE models with shared experts (DeepSeek): run the shared MLP on its "
                                     "own instead of as extra experts of the routed grouped GEMM",
    "disable_log_stats": "do not log engine throughput and cache usage every 10 s",
    "enable_log_requests": "log every request's prompt and sampling parameters (--disable-log-requests: "
                           "off)",
}
