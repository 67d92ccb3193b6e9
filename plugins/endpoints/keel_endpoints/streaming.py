"""Server-sent events and client-disconnect handling.

A client that goes away must have its request aborted at once, not when the next token fails to send:
`SSEResponse` and `run_until_disconnect` watch the ASGI `receive` channel for `http.disconnect` and
cancel the work, whose generators then abort their engine requests (`AsyncLLM.generate` does that when
closed early).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def sse_event(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (then returns None)."""
    done, result = await _race(work, request.receive)
    return result if done else None


class SSEResponse(StreamingResponse):
    """A text/event-stream response that cancels its body iterator as soon as the client disconnects
    (Starlette's own response notices only when a later write fails)."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _race(self.stream_response(send), receive)
        except OSError:  # the client vanished mid-write
            pass
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield `(index, item)` from several async iterators as items arrive; closing this generator
    cancels (and thereby closes) every source."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
