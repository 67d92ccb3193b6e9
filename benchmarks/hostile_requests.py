"""What hostile requests cost a running `keel serve` (demo model, loopback), and what other clients see.

    python benchmarks/hostile_requests.py [--out benchmarks/results/cpu-hostile-requests.json]

Starts `keel serve --model demo --trust-request-chat-template` in a subprocess and measures
- the largest bodies refused: a 100 GB Content-Length (refused before any byte is sent) and a 50 MB
  body streamed without one, with the time to the 413;
- a big prompt (15 MB, under the 16 MiB body limit, far past max_model_len), a heavy template (a loop of
  1e10 steps) and a huge template string (`'x' * 10**9`): the time to their 400, and the latency of a
  small completion sent by another client meanwhile (against the same request on an idle server);
- the server's RSS before and after, and its peak (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from keel.bench import source_commit

PROBE = {"model": "demo", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
HEAVY_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_STRING = "{% set s = 'x' * 10**9 %}{{ s }}"


def _rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            client.post("/v1/completions", json=PROBE).raise_for_status()
            out.append(time.monotonic() - t0)


def _while_probing(url: str, hostile: dict) -> dict:
    """Send `hostile` (route, body) once while another client keeps sending small completions."""
    stop, latencies = threading.Event(), []
    probe = threading.Thread(target=_probe_latencies, args=(url, stop, latencies))
    probe.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r = httpx.post(url + hostile["route"], content=hostile["body"],
                   headers={"Content-Type": "application/json"}, timeout=300)
    elapsed = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    probe.join()
    return {"status": r.status_code, "seconds_to_answer": round(elapsed, 3),
            "error": r.json().get("error", {}).get("message", "")[:160] if r.status_code >= 400 else None,
            "probe_requests": len(latencies), "probe_latency_ms_median": round(statistics.median(latencies) * 1e3, 1),
            "probe_latency_ms_max": round(max(latencies) * 1e3, 1)}


def _declared_huge(port: int) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000000\r\n\r\n")
        head = sock.recv(65536).split(b"\r\n", 1)[0].decode()
        return {"declared_bytes": 100_000_000_000, "status_line": head,
                "seconds_to_answer": round(time.monotonic() - t0, 4)}


def _streamed_huge(url: str) -> dict:
    size = 50 * 1024 * 1024

    def chunks():
        yield b'{"prompt": "'
        for _ in range(size // 65536):
            yield b"x" * 65536
        yield b'"}'

    t0 = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                       timeout=120)
        status = r.status_code
    except httpx.HTTPError as exc:  # the server may close while the rest is still being sent
        status = f"{type(exc).__name__} after the 413"
    return {"streamed_bytes": size, "status": status, "seconds_to_answer": round(time.monotonic() - t0, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "keel.cli", "serve", "--model", "demo", "--port", str(port), "--max-model-len",
           "1024", "--trust-request-chat-template", "--uvicorn-log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"keel serve did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(5):
                c.post("/v1/completions", json=PROBE)  # warm
            idle = []
            for _ in range(20):
                t0 = time.monotonic()
                c.post("/v1/completions", json=PROBE).raise_for_status()
                idle.append(time.monotonic() - t0)
        rss_before = _rss_kib(server.pid)
        big_prompt = json.dumps({"model": "demo", "prompt": "hello world " * (15 * 1024 * 1024 // 12)}).encode()
        chat = [{"role": "user", "content": "hi"}]
        results = {
            "idle_probe_latency_ms_median": round(statistics.median(idle) * 1e3, 1),
            "refused_declared_body": _declared_huge(port),
            "refused_streamed_body": _streamed_huge(url),
            "big_prompt_15MB": _while_probing(url, {"route": "/v1/completions", "body": big_prompt}),
            "template_loop_1e10": _while_probing(url, {"route": "/v1/chat/completions", "body": json.dumps(
                {"model": "demo", "messages": chat, "chat_template": HEAVY_LOOP}).encode()}),
            "template_x_times_1e9": _while_probing(url, {"route": "/v1/chat/completions", "body": json.dumps(
                {"model": "demo", "messages": chat, "chat_template": HUGE_STRING}).encode()}),
        }
        results["rss_kib_before"] = rss_before["VmRSS"]
        after = _rss_kib(server.pid)
        results["rss_kib_after"], results["rss_kib_peak"] = after["VmRSS"], after["VmHWM"]
        results["healthy_after"] = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        server.wait(timeout=30)
    commit = source_commit(Path(__file__).parent)
    report = {"benchmark": "hostile_requests", "script": "benchmarks/hostile_requests.py", "commit": commit,
              "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), **results}
    text = json.dumps(report, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
