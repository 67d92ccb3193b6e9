"""`LLM`: the offline API, as vLLM's.

    from keel import LLM, SamplingParams
    llm = LLM(model="path/to/hf-checkpoint")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from keel.config import EngineArgs
from keel.engine.llm_engine import LLMEngine
from keel.engine.outputs import RequestOutput
from keel.engine.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

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
