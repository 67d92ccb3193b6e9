"""The "openai" endpoint: POST /v1/completions, POST /v1/chat/completions and POST /v1/responses.

The HTTP side only: body decoding, model check, submission to the engine client, SSE transport and
disconnects. Request parsing, prompt rendering and response shapes belong to the IO processors
"completion" and "chat" (plugin io-processors), reached through `EndpointContext.io_processors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from keel.endpoint import EndpointContext
from keel.engine.output_processor import RequestOutputKind
from keel.engine.outputs import RequestOutput
from keel.io import EnginePrompt
from keel_endpoints.body import body_spec, read_json
from keel_endpoints.errors import OpenAIError, bad_request
from keel_endpoints.preprocess import run_preprocess
from keel_endpoints.streaming import SSEResponse, merge_async_iterators, run_until_disconnect, sse_event

logger = logging.getLogger("keel.endpoints")

# Errors raised by user input anywhere between the body and the engine's validation.
USER_ERRORS = (ValueError, TypeError)


def engine_input(prompt: EnginePrompt, cache_salt: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if prompt.prompt is not None:
        out["prompt"] = prompt.prompt
    if prompt.prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt.prompt_token_ids)
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return out


def json_body(proc: Any) -> dict[str, Any] | None:
    """The route's body for /openapi.json: the IO processor's schema, if it publishes one (routes read
    raw bodies, so FastAPI cannot see one)."""
    schema = proc.request_schema() if hasattr(proc, "request_schema") else None
    return body_spec(schema) if schema is not None else None


def check_model(ctx: EndpointContext, model: str | None) -> None:
    """404 for a model this server does not serve (`model` may be omitted)."""
    if model is not None and model != ctx.served_model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


async def start_generators(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The first output of every generator, concurrently; a failure (bad prompt) closes them all."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(anext(g)) for g in gens]  # type: ignore[arg-type]
    except BaseExceptionGroup as group:
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]
        raise group.exceptions[0] from None
    except BaseException:
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]
        raise
    return [t.result() for t in tasks]


async def _resume(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        if not first.finished:
            async for out in gen:
                yield out
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


class OpenAIEndpoint:
    """Registered by the API server; needs the "completion" and "chat" IO processors."""

    def register(self, app: FastAPI, ctx: EndpointContext) -> None:
        procs = dict(ctx.io_processors)
        for key in ("completion", "chat"):
            if key not in procs:
                raise RuntimeError(f"the openai endpoint needs the {key!r} io_processor (plugin io-processors)")

        @app.post("/v1/completions", openapi_extra=json_body(procs["completion"]))
        async def completions(request: Request) -> Response:
            return await self.handle(request, ctx, procs["completion"])

        @app.post("/v1/chat/completions", openapi_extra=json_body(procs["chat"]))
        async def chat_completions(request: Request) -> Response:
            return await self.handle(request, ctx, procs["chat"])

        if "responses" in procs:  # OpenAI's Responses API (text), served through the chat processor
            @app.post("/v1/responses", openapi_extra=json_body(procs["responses"]))
            async def responses(request: Request) -> Response:
                return await self.handle(request, ctx, procs["responses"])

    async def handle(self, raw: Request, ctx: EndpointContext, proc: Any) -> Response:
        engine = ctx.engine_client
        body = await read_json(raw)
        try:
            request = proc.parse_request(body)
            check_model(ctx, getattr(request, "model", None))
            params = proc.sampling_params(request)
            prompts = await run_preprocess(raw, proc.pre_process, request)
        except USER_ERRORS as exc:
            raise bad_request(exc) from None
        if getattr(request, "use_beam_search", False):
            return await self._beam_search(raw, ctx, proc, request, params, prompts)
        stream = proc.is_stream(request)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        rid = request.request_id
        salt, priority = getattr(request, "cache_salt", None), getattr(request, "priority", 0)
        gens = [
            engine.generate(engine_input(p, salt), params, rid if len(prompts) == 1 else f"{rid}-{i}",
                            output_kind=kind, **({"priority": priority} if priority else {}))
            for i, p in enumerate(prompts)
        ]
        # Validation happens on submission: start every request before answering, so that a bad
        # prompt is a 400 rather than a broken stream. A disconnect meanwhile aborts them all.
        try:
            firsts = await run_until_disconnect(raw, start_generators(gens))
        except USER_ERRORS as exc:
            raise bad_request(exc) from None
        if firsts is None:
            return Response(status_code=499)  # nobody is listening
        if not stream:
            return JSONResponse(proc.post_process(request, firsts))
        resumed = [_resume(first, gen) for first, gen in zip(firsts, gens)]
        return SSEResponse(self._events(proc, request, resumed))

    async def _beam_search(self, raw: Request, ctx: EndpointContext, proc: Any, request: Any, params: Any,
                           prompts: list[EnginePrompt]) -> Response:
        """`use_beam_search`: n beams per prompt (`keel_endpoints.beam_search`), answered once."""
        from keel_endpoints.beam_search import beam_search

        engine = ctx.engine_client
        rid = request.request_id
        try:
            ids = [list(p.prompt_token_ids) if p.prompt_token_ids is not None
                   else engine.processor.process_prompt(engine_input(p)).prompt_token_ids for p in prompts]
            searches = [beam_search(engine, p, f"{rid}-{i}", beam_width=params.n,
                                    max_tokens=params.max_tokens or engine.max_model_len - len(p),
                                    temperature=params.temperature, length_penalty=request.length_penalty,
                                    ignore_eos=params.ignore_eos, with_logprobs=params.logprobs is not None)
                        for i, p in enumerate(ids)]
            outs = await run_until_disconnect(raw, asyncio.gather(*searches))
        except USER_ERRORS as exc:
            raise bad_request(exc) from None
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(proc.post_process(request, outs))

    async def _events(self, proc: Any, request: Any, gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        stream = proc.create_stream(request)
        merged = merge_async_iterators(gens)
        try:
            async for index, out in merged:
                for chunk in stream.on_output(index, out):
                    yield sse_event(chunk)
            for chunk in stream.finish():
                yield sse_event(chunk)
        except Exception as exc:
            logger.exception("stream %s failed", request.request_id)
            yield sse_event(OpenAIError(500, f"{type(exc).__name__}: {exc}").body())
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
        yield sse_event("[DONE]")
