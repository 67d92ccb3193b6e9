"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every error the server
returns -- including FastAPI's own (unknown route, wrong method) and unexpected failures."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from keel.engine.engine_client import EngineDeadError

logger = logging.getLogger("keel.endpoints")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          503: "server_error"}


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting the request (a model name, a template
    error) may hold text that UTF-8 cannot encode, and the error must still render."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class OpenAIError(Exception):
    """Raised by route handlers; rendered as an OpenAI error response with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(exc: Exception) -> OpenAIError:
    """A user error (ValueError and friends) as HTTP 400, keeping a `param` the exception names."""
    return OpenAIError(400, getattr(exc, "message", None) or str(exc) or type(exc).__name__,
                       param=getattr(exc, "param", None))


def install_error_handlers(app: FastAPI) -> None:
    """Called once by `build_app`."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        return OpenAIError(400, f"{loc}: {err.get('msg', 'invalid request')}", param=loc or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        # The server's fault, not the request's, and lasting: the same 503 as /health.
        return OpenAIError(503, f"the engine is not available: {exc}").response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        # The server closes the connection after an unhandled error (Starlette re-raises it to
        # uvicorn): saying so keeps a pooled keep-alive client from sending its next request into it.
        return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}").response(
            headers={"Connection": "close"})
