"""`LLM`: the offline API, as vLLM's.

    from keel import LLM, SamplingParams
    llm = LLM(model="path/to/hf-checkpoint")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keel.config import EngineArgs

if TYPE_CHECKING:
    from keel.engine.beam_search import BeamSearchOutput, BeamSearchParams
from keel.engine.llm_engine import LLMEngine
from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any]  # text, or keel.inputs.TextPrompt / TokensPrompt


# EngineArgs fields of the server only: the offline engine runs its core in this process, unwatched.
SERVER_ONLY_ARGS = ("engine_core_process", "engine_iteration_timeout_s")


class LLM:
    """The offline engine: `generate` / `chat` run prompts to completion in this process.

    Every argument but `model` is keyword-only and mirrors vLLM's `LLM(...)` / engine argument of the
    same name. None means "not set": the profile decides, else keel's built-in default (in brackets
    below). A vLLM argument keel does not implement is a TypeError naming it.

    Model: `model` (a checkpoint folder, a Hub id, or "demo"), `tokenizer` [the model], `dtype` [auto],
    `seed` [0], `max_model_len` [max_position_embeddings], `skip_tokenizer_init`, `trust_remote_code`,
    `revision`, `served_model_name`, `load_format` ("auto" | "dummy"), `generation_config` ("auto" |
    "vllm" | a folder), `quantization` [the checkpoint's], `max_logprobs` [20], `logits_processors` (logits_processor plugin
    keys, "pkg.module:Class" names or classes), `disable_shared_experts_fusion` [False] (SGLang's).
    Cache: `block_size` [16], `enable_prefix_caching` [True], `kv_cache_memory_bytes`, `num_kv_blocks`,
    `gpu_memory_utilization` [0.9], `kv_cache_dtype` ["auto"].
    Scheduler: `max_num_seqs` [256], `max_num_batched_tokens`, `enable_chunked_prefill` [True],
    `async_scheduling` [on off the CPU], `scheduling_policy` ["fcfs" | "priority"].
    Parallelism: `tensor_parallel_size` [1], `pipeline_parallel_size` [1], `data_parallel_size` [1],
    `enable_expert_parallel`,
    `distributed_executor_backend` ("uni" | "mp" | "ray").
    Device: `platform` ["auto"], `attention_backend` ["auto"], `enforce_eager` [False].
    Speculative decoding: `speculative_config` ({"method": ..., "num_speculative_tokens": ...}).
    keel's own: `plugins` (entry-point names or "auto"), `profile` (a profile name or YAML path),
    `plugin_options` (values of options that plugins define).
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        max_model_len: int | None = None,
        skip_tokenizer_init: bool | None = None,
        trust_remote_code: bool | None = None,
        revision: str | None = None,
        served_model_name: str | None = None,
        load_format: str | None = None,
        generation_config: str | None = None,
        quantization: str | None = None,
        max_logprobs: int | None = None,
        logits_processors: list[str | type] | None = None,
        disable_shared_experts_fusion: bool | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool | None = None,
        kv_cache_memory_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_dtype: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool | None = None,
        async_scheduling: bool | None = None,
        scheduling_policy: str | None = None,
        tensor_parallel_size: int | None = None,
        pipeline_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        enable_expert_parallel: bool | None = None,
        distributed_executor_backend: str | None = None,
        platform: str | None = None,
        attention_backend: str | None = None,
        enforce_eager: bool | None = None,
        speculative_config: dict[str, Any] | None = None,
        plugins: list[str] | str | None = None,
        profile: str | None = None,
        plugin_options: dict[str, Any] | None = None,
    ) -> None:
        values = dict(locals())
        args = EngineArgs(**{name: values[name] for name in _LLM_ARGS})
        self.llm_engine = LLMEngine.from_engine_args(args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens); plain defaults where it sets none. As vLLM's."""
        from keel.models.generation_config import default_sampling_overrides

        return SamplingParams(**default_sampling_overrides(self.llm_engine.config.model.generation_config_fields))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All prompts are validated before any is queued, so one bad prompt raises without side effects.
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        for p, sp in zip(prompts, params):  # validate all first: one bad prompt queues nothing
            engine.processor.process_prompt(p)
            engine.processor.check_token_ids(sp)
            engine.processor.check_structured_outputs(sp)
        ids = []
        for prompt, sp in zip(prompts, params):
            rid = engine.next_request_id()
            engine.add_request(rid, prompt, sp)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (and `tools`, OpenAI tool objects
        the template renders, as vLLM's `LLM.chat`), then generate. Outputs are raw text: parsing tool
        calls out of it is the server's (`tool_call_parser`) or the caller's."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was given)")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template; pass chat_template=...")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(
                list(conv), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=True, **({"tools": list(tools)} if tools is not None else {}),
            )
            if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(results) < len(request_ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in request_ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in request_ids]

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (`keel.engine.beam_search`): the best `params.beam_width` sequences
        of each prompt, by cumulative logprob over length ** length_penalty; prompts are checked first."""
        from keel.engine.beam_search import beam_search

        return beam_search(self, prompts, params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's); False, with nothing done, while a request holds blocks."""
        return self.llm_engine.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free device memory between batches, as vLLM's `LLM.sleep`: level 1 frees the KV cache (unlike
        vLLM, the weights stay in device memory), level 2 frees the weights too. Cached prefixes are
        forgotten; `generate` raises until `wake_up()`. Needs no request in flight."""
        self.llm_engine.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed: `tags` among "weights" (reloaded from the checkpoint) and
        "kv_cache" (allocated again); None restores both."""
        self.llm_engine.core.wake_up(tags)

    def get_metrics(self) -> dict[str, Any]:
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Release the engine; plugins see `keel_shutdown` once. Also run when the LLM is collected."""
        engine = self.__dict__.get("llm_engine")
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        # At interpreter teardown the engine's modules may be gone already: nothing left to tell then.
        with contextlib.suppress(Exception):
            self.shutdown()


_LLM_ARGS = [f.name for f in dataclasses.fields(EngineArgs) if f.name not in SERVER_ONLY_ARGS]
