"""/tokenize, /detokenize, /tokenizer_info (vLLM's shapes) and /metrics (Prometheus text)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from keel.endpoint import EndpointContext
from keel.engine.prompt_bound import PromptBound
from keel.io import inline_refs
from keel_endpoints.body import body_spec, read_json
from keel_endpoints.errors import OpenAIError, bad_request
from keel_endpoints.preprocess import run_preprocess


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def parse_body(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if not (isinstance(p, str) and "[" in p))
        raise OpenAIError(400, f"{loc}: {err['msg']}", param=loc or None) from None


def _check_model(ctx: EndpointContext, model: str | None) -> None:
    if model is not None and model != ctx.served_model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _cache_info(ctx: EndpointContext) -> dict[str, Any]:
    """vLLM's `cache_config_info` labels, from the engine's cache section (if the config has one)."""
    cache = getattr(ctx.config, "cache", None)
    if cache is None:
        return {}
    info = {"block_size": cache.block_size, "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization}
    blocks = getattr(ctx.engine_client, "num_kv_blocks", None)
    if blocks is not None:
        info["num_gpu_blocks"] = blocks
    return info


def tokenizer_info(tok: Any) -> dict[str, Any]:
    """vLLM's /tokenizer_info body: the tokenizer's class and its JSON-serializable init settings."""
    settings = {k: v for k, v in getattr(tok, "init_kwargs", {}).items() if k != "name_or_path"}
    # AddedToken objects (also inside added_tokens_decoder) become their text; other objects their str
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, **json.loads(json.dumps(
        settings, default=lambda o: getattr(o, "content", None) or str(o)))}
    info.setdefault("model_max_length", getattr(tok, "model_max_length", None))
    info["chat_template"] = getattr(tok, "chat_template", None)
    return info


def register_utility_routes(app: FastAPI, ctx: EndpointContext, server_config: Any = None) -> None:
    """Called by the api_server endpoint. /metrics attaches a Prometheus stat logger to the engine."""
    from keel_endpoints.options import ServerConfig
    from keel_endpoints.prometheus import CONTENT_TYPE, PrometheusStatLogger

    options = server_config or ServerConfig()
    engine = ctx.engine_client
    procs = dict(ctx.io_processors)
    stat_logger = PrometheusStatLogger(ctx.served_model_name, prefix=options.metrics_prefix,
                                       max_model_len=engine.max_model_len, cache_info=_cache_info(ctx))
    if hasattr(engine, "add_stat_logger"):
        engine.add_stat_logger(stat_logger)
    app.state.keel_stat_logger = stat_logger

    # A prompt far past max_model_len is refused after a prefix, not tokenized whole on the shared thread.
    bound = PromptBound(engine.get_tokenizer(), engine.max_model_len)

    def tokenizer() -> Any:
        tok = engine.get_tokenizer()
        if tok is None:
            raise OpenAIError(400, "this server runs without a tokenizer (skip_tokenizer_init)")
        return tok

    @app.post("/tokenize", openapi_extra=body_spec(inline_refs(TokenizeRequest.model_json_schema())))
    async def tokenize(request: Request) -> JSONResponse:
        req = parse_body(TokenizeRequest, await read_json(request))
        _check_model(ctx, req.model)
        tokenizer()  # 400 without one
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        try:
            if req.messages is not None:
                if "chat" not in procs:
                    raise OpenAIError(400, "tokenizing messages needs the 'chat' io_processor", param="messages")
                chat = procs["chat"]
                body = {"messages": req.messages, "add_generation_prompt": req.add_generation_prompt}
                parsed = chat.parse_request(body)
                ids = [int(t) for p in await run_preprocess(request, chat.pre_process, parsed)
                       for t in p.prompt_token_ids]
            else:
                ids = await run_preprocess(
                    request, lambda: bound.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    @app.post("/detokenize", openapi_extra=body_spec(inline_refs(DetokenizeRequest.model_json_schema())))
    async def detokenize(request: Request) -> JSONResponse:
        req = parse_body(DetokenizeRequest, await read_json(request))
        _check_model(ctx, req.model)
        tok = tokenizer()
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id(s) {bad[:5]} out of vocabulary range [0, {vocab})", param="tokens")
        text = await run_preprocess(request, tok.decode, req.tokens)
        return JSONResponse({"prompt": text})

    if options.enable_tokenizer_info_endpoint:  # off by default, as in vLLM: it shows the chat template
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            return JSONResponse(tokenizer_info(tokenizer()))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE)
