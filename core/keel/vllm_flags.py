"""vLLM command-line flags keel does not implement: each is an error naming it, never silently dropped.

`refuse_unimplemented_vllm_flags(parser)` runs after every other flag is added (engine flags, the
command's own, the loaded plugins'), so a flag keel or a plugin implements is never refused; a flag
implemented later simply leaves this table. Hidden from --help: they are not keel's flags.
"""

from __future__ import annotations

import argparse

# flag -> why keel has none (the error message's second half)
UNIMPLEMENTED: dict[str, str] = {
    "--swap-space": "preempted requests are recomputed, never swapped to host memory",
    "--cpu-offload-gb": "weights are never offloaded to host memory",
    "--preemption-mode": "preemption always recomputes",
    "--tokenizer-mode": "the checkpoint's fast tokenizer is always used",
    "--tokenizer-revision": "the tokenizer is read at --revision",
    "--code-revision": "no remote-code revision pinning",
    "--download-dir": "Hub downloads go to huggingface_hub's cache (HF_HOME)",
    "--hf-token": "huggingface_hub reads HF_TOKEN",
    "--hf-overrides": "no config overrides",
    "--hf-config-path": "the config is read from the model folder",
    "--config-format": "config.json only",
    "--config": "no YAML config file: keel's equivalent is --profile",
    "--model-loader-extra-config": "no loader options",
    "--safetensors-load-strategy": "shards are read lazily, one loader",
    "--max-parallel-loading-workers": "one loader per rank",
    "--rope-scaling": "no config overrides",
    "--rope-theta": "no config overrides",
    "--override-generation-config": "use --generation-config with a folder",
    "--max-seq-len-to-capture": "decode CUDA graphs cover every context length",
    "--cuda-graph-sizes": "the platform chooses the captured batch sizes",
    "--compilation-config": "no torch.compile configuration",
    "-O": "no torch.compile configuration",
    "--disable-sliding-window": "sliding windows are always honoured",
    "--disable-cascade-attn": "no cascade attention",
    "--disable-custom-all-reduce": "collectives go through the platform's communicator",
    "--logits-processor-pattern": "no per-request logits processors; engine-wide --logits-processors only",
    "--enable-sleep-mode": "not needed: LLM.sleep() / wake_up() work without it",
    "--model-impl": "keel's own model implementations only",
    "--runner": "generation models only",
    "--convert": "generation models only",
    "--task": "generation models only",
    "--pooler-config": "no pooling models yet",
    "--override-pooler-config": "no pooling models yet",
    "--data-parallel-rank": "the data-parallel replicas live in one engine core (--data-parallel-size)",
    "--data-parallel-address": "the data-parallel replicas live in one engine core (--data-parallel-size)",
    "--data-parallel-rpc-port": "the data-parallel replicas live in one engine core (--data-parallel-size)",
    "--data-parallel-backend": "the data-parallel replicas live in one engine core (--data-parallel-size)",
    "--api-server-count": "one API server process",
    "--headless": "the data-parallel replicas live in one engine core (--data-parallel-size)",
    "--enable-eplb": "no expert load balancing",
    "--num-redundant-experts": "no expert load balancing",
    "--worker-cls": "workers are keel's",
    "--worker-extension-cls": "workers are keel's",
    "--ray-workers-use-nsight": "no profiler integration",
    "--enable-lora": "no LoRA adapters yet",
    "--max-loras": "no LoRA adapters yet",
    "--max-lora-rank": "no LoRA adapters yet",
    "--max-cpu-loras": "no LoRA adapters yet",
    "--lora-modules": "no LoRA adapters yet",
    "--lora-dtype": "no LoRA adapters yet",
    "--fully-sharded-loras": "no LoRA adapters yet",
    "--limit-mm-per-prompt": "text models only",
    "--mm-processor-kwargs": "text models only",
    "--allowed-local-media-path": "text models only",
    "--kv-transfer-config": "KV connectors are plugins chosen by the profile",
    "--kv-events-config": "no KV cache events",
    "--prefix-caching-hash-algo": "one prefix hash",
    "--calculate-kv-scales": "fp8 KV caches use unit scales",
    "--num-lookahead-slots": "lookahead slots follow --speculative-config",
    "--max-num-partial-prefills": "one token budget schedules prefills",
    "--max-long-partial-prefills": "one token budget schedules prefills",
    "--long-prefill-token-threshold": "one token budget schedules prefills",
    "--scheduler-cls": "one scheduler",
    "--otlp-traces-endpoint": "no tracing",
    "--collect-detailed-traces": "no tracing",
    "--show-hidden-metrics-for-version": "no hidden metrics",
    "--uds": "TCP only: use --host and --port",
    "--ssl-keyfile": "no TLS in the server: put it behind a TLS proxy",
    "--ssl-certfile": "no TLS in the server: put it behind a TLS proxy",
    "--ssl-ca-certs": "no TLS in the server: put it behind a TLS proxy",
    "--root-path": "no root path: put it behind a proxy",
    "--middleware": "no custom middleware",
    "--allowed-origins": "no CORS configuration",
    "--allow-credentials": "no CORS configuration",
    "--allowed-methods": "no CORS configuration",
    "--allowed-headers": "no CORS configuration",
    "--response-role": "the assistant role is 'assistant'",
    "--chat-template-content-format": "message content is rendered as the template expects (auto)",
    "--max-log-len": "request logs print the whole prompt",
    "--log-config-file": "logging is configured by --log-level",
    "--disable-frontend-multiprocessing": "the front end runs in the server process; see "
                                          "--engine-core-process",
    "--enable-request-id-headers": "no request id headers",
    "--enable-auto-tool-choice": "tool_choice 'auto' is on whenever --tool-call-parser names a parser",
    "--tool-parser-plugin": "tool parsers are tool_parser plugins",
    "--guided-decoding-backend": "the structured_output backend is a plugin (xgrammar)",
    "--structured-outputs-config": "the structured_output backend is a plugin (xgrammar)",
}


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a vLLM flag keel does not implement ({UNIMPLEMENTED[self.dest_flag]})")

    def __init__(self, *args, dest_flag: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.dest_flag = dest_flag


def refuse_unimplemented_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Make each vLLM flag of `UNIMPLEMENTED` that `parser` does not have an error naming it."""
    taken = set(parser._option_string_actions)
    for flag in UNIMPLEMENTED:
        if flag not in taken:
            parser.add_argument(flag, dest="_keel_refused", nargs="?", action=_Refuse, dest_flag=flag,
                               help=argparse.SUPPRESS)
