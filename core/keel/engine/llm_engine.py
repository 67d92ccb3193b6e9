"""LLMEngine: the synchronous front end -- processor, engine core, output processor.

`add_request` tokenizes and validates; `step` runs one engine-core step and returns the RequestOutputs
that became ready. Stop strings found while detokenizing abort the request in the core at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from keel.config import EngineArgs, EngineConfig
from keel.engine.core import EngineCore
from keel.engine.output_processor import OutputProcessor, RequestOutputKind
from keel.engine.outputs import RequestOutput
from keel.engine.processor import Processor
from keel.engine.sampling_params import SamplingParams
from keel.logits_processor import resolve_logits_processors
from keel.structured_output.manager import loaded, select_backend

logger = logging.getLogger("keel.engine")


def resolve_model_shortcut(args: EngineArgs) -> None:
    """`model="demo"` names the small local demo checkpoint, built on first use; it keeps serving
    under the name "demo" (not the cache path) unless served_model_name says otherwise."""
    if args.model == "demo":
        from keel.demo import build_demo_checkpoint, default_demo_path

        args.model = str(build_demo_checkpoint(default_demo_path()))
        logger.warning("model 'demo': a tiny model with random weights, built on this machine -- its text is "
                       "noise, not answers (%s)", args.model)
        if args.served_model_name is None:
            args.served_model_name = "demo"


def load_tokenizer(config: EngineConfig):
    mc = config.model
    if mc.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    from keel.models.checkpoint_files import CheckpointError, check_tokenizer_dir, local_model_dir, one_line
    from keel.models.loader import resolve_model_path

    path = mc.tokenizer or mc.model
    if path == mc.model:
        path = str(resolve_model_path(mc.model, mc.revision))
    local = local_model_dir(path)
    if local is not None:
        check_tokenizer_dir(local)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=mc.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 -- tokenizers' own errors are bare Exceptions
        raise CheckpointError(f"cannot load the tokenizer from {path}: {one_line(exc)}") from exc


def _eos_token_id(tokenizer, hf_config) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


POOLING_ONLY = ("this model is an embedding (pooling) model: it serves pooling requests only "
                "(/v1/embeddings, /pooling, AsyncLLM.encode), not generation")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.core = EngineCore(config)
        hf_config = config.model.hf_config
        self.processor = Processor(
            self.tokenizer,
            max_model_len=self.core.max_model_len,
            vocab_size=hf_config.vocab_size,
            eos_token_id=_eos_token_id(self.tokenizer, hf_config),
            seed=config.model.seed,
            generation_config=config.model.generation_config_fields, max_logprobs=config.model.max_logprobs,
            structured_output_backend=loaded(select_backend(config.plugin_set())),
            scheduling_policy=config.scheduler.scheduling_policy,
            logits_processors=resolve_logits_processors(config.model.logits_processors, config.plugin_set()),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = 0
        from keel.models.registry import is_pooling_model

        self.is_pooling_model = is_pooling_model(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        resolve_model_shortcut(args)
        return cls(args.create_engine_config())

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter - 1)

    def add_request(
        self,
        request_id: str,
        prompt: str | Mapping[str, Any] | list[int],
        params: SamplingParams,
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input. `priority`
        orders requests under the "priority" scheduling policy (lower first); elsewhere it must be 0."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.is_pooling_model:
            raise ValueError(POOLING_ONLY)
        self.core.check_awake()
        arrival = time.time()
        processed = self.processor.process_prompt(prompt)
        max_tokens = self.processor.max_tokens(params, len(processed.prompt_token_ids))
        core_requests = self.processor.make_requests(request_id, processed, params, time.monotonic(), priority)
        self.output_processor.add_request(
            request_id, [r.request_id for r in core_requests], processed, params, kind, arrival
        )
        for r in core_requests:
            self.core.add_request(r, max_tokens)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort_request(request_id)[0])

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        ready, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.core.abort_requests(stopped)
        return ready

    def shutdown(self) -> None:
        self.core.shutdown()

    def get_metrics(self) -> dict[str, Any]:
        return self.core.get_stats().as_metrics()
