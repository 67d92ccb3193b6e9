"""`keel serve`: flags, a clear error without the server plugin, and a real process answering /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from keel.cli import build_parser, main

pytest.importorskip("keel_endpoints")
from keel_endpoints.testing import make_tiny_model


def test_serve_flags():
    argv = ["serve", "--model", "m", "--host", "0.0.0.0", "--port", "9", "--api-key", "k",
            "--served-model-name", "n", "--dtype", "float32", "--max-model-len", "32", "--profile", "cpu"]
    ns = build_parser(argv).parse_args(argv)
    assert (ns.host, ns.port, ns.api_key, ns.served_model_name, ns.dtype, ns.max_model_len) == (
        "0.0.0.0", 9, "k", "n", "float32", 32)


def test_serve_without_the_endpoints_plugin_fails_clearly(tmp_path, capsys):
    path = make_tiny_model(tmp_path / "m")
    profile = tmp_path / "bare.yaml"
    profile.write_text("plugins: [platform-cpu, attention-torch, models-llama]\n")
    assert main(["serve", "--model", str(path), "--profile", str(profile), "--num-kv-blocks", "8",
                 "--max-model-len", "32"]) == 1
    assert "keel-endpoints" in capsys.readouterr().err


def test_keel_serve_process_answers(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "keel.cli", "serve", "--model", str(path), "--profile", "cpu", "--port", str(port),
           "--served-model-name", "tiny", "--max-model-len", "64", "--num-kv-blocks", "32", "--api-key", "k",
           "--engine-core-process"]  # the other server tests run the core on a thread
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "keel serve did not come up"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_server_flags_reach_the_server_config(monkeypatch):
    from keel_endpoints.options import ServerConfig

    from keel.config import EngineArgs

    # build_parser reads the plugins to load from the argv of the last `main` (another test's here).
    monkeypatch.setattr("keel.cli._argv", [])
    argv = ["serve", "--model", "m", "--profile", "cpu", "--max-request-body-bytes", "2MiB",
            "--trust-request-chat-template", "--chat-template-timeout-s", "0.5", "--chat-template-max-chars", "1000",
            "--preprocess-threads", "2"]
    ns = build_parser(argv).parse_args(argv)
    config = ServerConfig.from_plugin_options(EngineArgs.from_cli_args(ns).plugin_options)
    assert config.max_request_body_bytes == 2 << 20 and config.preprocess_threads == 2
    limits = config.request_limits
    assert (limits.trust_request_chat_template, limits.chat_template_timeout_s, limits.chat_template_max_chars) == (
        True, 0.5, 1000)
    default = ServerConfig.from_plugin_options(EngineArgs.from_cli_args(build_parser(argv[:5]).parse_args(argv[:5]))
                                               .plugin_options)
    assert default == ServerConfig() and not default.request_limits.trust_request_chat_template
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args([*argv[:5], "--max-request-body-bytes", "lots"])


def test_metrics_prefix_tokenizer_info_and_scheduling_policy_flags(monkeypatch):
    from keel_endpoints.options import ServerConfig

    from keel.config import EngineArgs

    monkeypatch.setattr("keel.cli._argv", [])
    argv = ["serve", "--model", "m", "--profile", "cpu", "--metrics-prefix", "vllm",
            "--enable-tokenizer-info-endpoint", "--scheduling-policy", "priority"]
    args = EngineArgs.from_cli_args(build_parser(argv).parse_args(argv))
    config = ServerConfig.from_plugin_options(args.plugin_options)
    assert config.metrics_prefix == "vllm" and config.enable_tokenizer_info_endpoint
    assert args.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args([*argv[:5], "--metrics-prefix", "sglang"])
