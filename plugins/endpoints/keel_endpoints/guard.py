"""What every request body must satisfy before a route sees it: a JSON content type and a size limit.

`RequestGuard` is pure ASGI (no response buffering: streams and disconnects pass through untouched).
On POST / PUT / PATCH it answers
- 415 unless the content type is `application/json`: a browser page can send a cross-site "simple"
  request (form or text/plain) to a server on localhost without a preflight, never a JSON one;
- 413 when `Content-Length` says the body is too large (before reading a byte of it), or as soon as a
  body without one grows past the limit; the connection is closed, since the rest of the body is
  still on its way.
The body it read is handed to the app unchanged; later `receive` calls (disconnects) pass through.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keel_endpoints.errors import OpenAIError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _media_type(headers: dict[bytes, bytes]) -> str:
    return headers.get(b"content-type", b"").split(b";", 1)[0].strip().decode("latin-1").lower()


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: str) -> OpenAIError:
        return OpenAIError(413, f"the request body ({size}) exceeds this server's limit of {self.max_body_bytes} "
                                "bytes (keel serve --max-request-body-bytes)", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if _media_type(headers) != "application/json":
            error = OpenAIError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                                code="unsupported_media_type")
            await error.response()(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(f"{int(declared)} bytes").response(headers={"Connection": "close"})(
                scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(f"more than {self.max_body_bytes} bytes").response(
                    headers={"Connection": "close"})(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
