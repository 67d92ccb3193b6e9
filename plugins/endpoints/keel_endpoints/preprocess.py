"""Request preprocessing -- parsing prompts, rendering chat templates, tokenizing -- on the server's own
threads, off the event loop.

The engine has one tokenizer thread, which every request passes through when it is submitted; a long
tokenization or a chat template at its time budget there would hold up every other client. Routes run
their IO processor's `pre_process` (and /tokenize its encode) here instead: `ServerConfig.
preprocess_threads` threads per app, so one slow request holds one of them, and the engine's thread
only ever sees cheap work.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request


def install_preprocess_pool(app: FastAPI, threads: int) -> None:
    """Called once by `build_app`; the threads go when the app does."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="keel-preprocess")
    app.state.keel_preprocess = pool
    weakref.finalize(app, pool.shutdown, wait=False, cancel_futures=True)


async def run_preprocess(request: Request, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the app's preprocessing threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app.state.keel_preprocess, functools.partial(fn, *args))
