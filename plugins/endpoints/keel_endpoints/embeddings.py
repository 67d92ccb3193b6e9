"""The "embeddings" endpoint: POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's), served by
an embedding (pooling) model through `AsyncLLM.encode`. A generation model answers them with a 400."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from keel.endpoint import EndpointContext
from keel.engine.limits import INT64_MAX, INT64_MIN
from keel.engine.pooling_params import PoolingParams
from keel.io import inline_refs
from keel_endpoints.body import body_spec, read_json
from keel_endpoints.errors import OpenAIError, bad_request
from keel_endpoints.openai import check_model, start_generators
from keel_endpoints.streaming import run_until_disconnect
from keel_endpoints.utility import parse_body

logger = logging.getLogger("keel.endpoints")
MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool = True  # vLLM extra
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # vLLM extra


# Fields vLLM defines on these requests that keel does not act on: a 400 naming them.
UNSUPPORTED = ("truncate_prompt_tokens", "add_special_tokens", "softmax", "activation", "use_activation",
               "chat_template", "messages", "mm_processor_kwargs")


def prompts_of(value: Any) -> list[Any]:
    """`input` as a list of engine prompts (texts or token-id lists)."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": list(value)}]
    return [v if isinstance(v, str) else {"prompt_token_ids": list(v)} for v in value]


def encode_vector(vector: Any, encoding_format: str) -> Any:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingsEndpoint:
    """Registered by the API server for every profile with the endpoints plugin."""

    def register(self, app: FastAPI, ctx: EndpointContext) -> None:
        spec = body_spec(inline_refs(EmbeddingRequest.model_json_schema()))

        @app.post("/v1/embeddings", openapi_extra=spec)
        async def embeddings(request: Request) -> Response:
            return await self.handle(request, ctx, "embedding")

        @app.post("/pooling", openapi_extra=spec)
        async def pooling(request: Request) -> Response:
            return await self.handle(request, ctx, "pooling")

    async def handle(self, raw: Request, ctx: EndpointContext, kind: str) -> Response:
        engine = ctx.engine_client
        req = parse_body(EmbeddingRequest, await read_json(raw))
        check_model(ctx, req.model)
        extra = req.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) is not None:
                raise OpenAIError(400, f"{name} is not supported by this server's {kind} requests; remove the field",
                                  param=name)
        for name in extra:
            logger.warning("the %s request field %r is not known and was ignored", kind, name)
        if not getattr(engine, "is_pooling_model", False):
            raise OpenAIError(400, f"the model `{ctx.served_model_name}` does not support the {kind} API: it is a "
                                   "generation model (serve an embedding model)", param="model")
        prompts = prompts_of(req.input)
        if not prompts or len(prompts) > MAX_INPUTS:
            raise OpenAIError(400, f"input must hold 1 to {MAX_INPUTS} items, got {len(prompts)}", param="input")
        try:
            params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        except ValueError as exc:
            raise bad_request(exc) from None
        rid = f"embd-{uuid.uuid4().hex}"
        gens = [engine.encode(p, params, f"{rid}-{i}", priority=req.priority) for i, p in enumerate(prompts)]
        try:
            outs = await run_until_disconnect(raw, start_generators(gens))
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        if outs is None:
            return Response(status_code=499)
        num_tokens = sum(len(o.prompt_token_ids) for o in outs)
        item_key = "embedding" if kind == "embedding" else "data"
        data = [{"index": i, "object": kind, item_key: encode_vector(o.outputs.data, req.encoding_format)}
                for i, o in enumerate(outs)]
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()),
                             "model": ctx.served_model_name, "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
