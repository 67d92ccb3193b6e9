"""A bounded load generator: N concurrent streaming clients against a running server, each checked.

    python -m keel_endpoints.loadgen --base-url http://127.0.0.1:8000/v1 --clients 64 --max-tokens 16

Every client streams one chat or completion request with the official `openai` client and records its
text, chunk count, finish reason, usage and latencies; the run is bounded by `--clients` and a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StreamResult:
    prompt: str
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    ttft: float | None = None
    latency: float = 0.0
    chunks_after_finish: int = 0
    error: str | None = None
    finish_reasons: list[str] = field(default_factory=list)


async def stream_one(client: Any, model: str, prompt: str, max_tokens: int, **extra: Any) -> StreamResult:
    result = StreamResult(prompt)
    start = time.monotonic()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, **extra)
        async for chunk in stream:
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if result.ttft is None and choice.text:
                    result.ttft = time.monotonic() - start
                if result.finish_reason is not None:
                    result.chunks_after_finish += 1
                result.chunks += 1
                result.text += choice.text
                if choice.finish_reason is not None:
                    result.finish_reason = choice.finish_reason
                    result.finish_reasons.append(choice.finish_reason)
    except Exception as exc:  # noqa: BLE001 -- a load run reports failures instead of stopping
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.monotonic() - start
    return result


async def run_load(base_url: str, prompts: list[str], *, clients: int, max_tokens: int, model: str,
                   api_key: str = "EMPTY", timeout: float = 120.0, **extra: Any) -> list[StreamResult]:
    """`clients` concurrent streams (prompts used round-robin), all started at once."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout) as client:
        jobs = [stream_one(client, model, prompts[i % len(prompts)], max_tokens, **extra) for i in range(clients)]
        return list(await asyncio.wait_for(asyncio.gather(*jobs), timeout))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", action="append", default=None)
    ns = p.parse_args()
    prompts = ns.prompt or ["Hello, world!", "The quick brown fox", "Once upon a time"]
    t0 = time.monotonic()
    results = asyncio.run(run_load(ns.base_url, prompts, clients=ns.clients, max_tokens=ns.max_tokens,
                                   model=ns.model, api_key=ns.api_key))
    wall = time.monotonic() - t0
    failed = [r for r in results if r.error or r.finish_reason is None]
    print(json.dumps({"clients": ns.clients, "wall_s": round(wall, 3), "failed": len(failed),
                      "errors": [asdict(r) for r in failed[:3]]}, indent=2))


if __name__ == "__main__":
    main()
