"""Issue 22, items 3 and 17: HTTP clients with deadlines (fixed by the HTTP transport of issue
29, transport/http_client.py; these tests hold issue 22's cases)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time

import pytest
from fakes.deadlines import run_with_deadline
from fakes.fake_http import LocalHTTPServer

from mirageflow.config.types import ProcessorConfig, ServerArgs
from mirageflow.engines.base import EngineError, Request


pytestmark = pytest.mark.usefixtures("no_proxy")


def _serve(handler_class) -> LocalHTTPServer:
    server = LocalHTTPServer()
    server.listen("127.0.0.1", 0, handler_class)
    return server.start()


def _processor(backend: str, **fields) -> ProcessorConfig:
    defaults = dict(
        type="llm", backend=backend, server_args=ServerArgs(model_path="m"), sampling_params={}, chat_template_kwargs={},
        apply_chat_template=True, torch_threads=None, request_timeout=10.0, max_retries=2,
    )  # fmt: skip
    defaults.update(fields)
    return ProcessorConfig(**defaults)


@pytest.mark.parametrize("hang_seconds", [None, 2.0], ids=["unwatched", "not-replaced"])
def test_item3_a_frozen_shared_engine_fails_its_shards_within_a_bounded_time(tmp_path, monkeypatch, hang_seconds):
    """Item 3: an engine service that stops answering (SIGSTOPped: connections open, no
    bytes) hung all its shards (`Timeout(None, connect=30)`); it must fail them, naming the
    endpoint, within a bounded time: at once when nothing watches it (hang_seconds null), else
    once its engine job had hang_seconds plus the restart wait to replace it and did not (here
    no engine job runs: the endpoint names this test's process)."""
    from mirageflow.engines import shared

    frozen = threading.Event()

    class Service(http.server.BaseHTTPRequestHandler):
        def _json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if frozen.is_set():
                time.sleep(3600)
            if self.path == "/health":
                self._json({"state": "ready"})
            elif self.path == "/info":
                self._json({
                    "group": 0, "stats_file": "s.json", "num_gpus": 0, "shards": 1,
                    "engines": {"llm": {"info": {"backend": "transformers", "model_path": "m"}, "max_inflight": 4, "chat_template": None}},
                })  # fmt: skip

        def do_POST(self):
            frozen.set()
            time.sleep(3600)

        def log_message(self, *args):
            pass

    server = _serve(Service)
    endpoint = tmp_path / "engine_0.json"
    endpoint.write_text(json.dumps({
        "state": "ready", "host": "127.0.0.1", "port": server.httpd.server_address[1], "hostname": socket.gethostname(), "pid": os.getpid(),
    }))  # fmt: skip
    monkeypatch.setattr(shared, "HEARTBEAT_SECONDS", 0.5)
    monkeypatch.setattr(shared, "HEARTBEAT_TIMEOUT", 5.0)  # the bound, not its 60 s default, is under test
    monkeypatch.setenv("MIRAGEFLOW_ENGINE_RESTART_WAIT", "3")
    engine = shared.SharedEngine(_processor("transformers", hang_seconds=hang_seconds), 4, endpoint=endpoint)
    engine.load()
    try:
        from fakes import drive

        request = Request(0, [{"role": "user", "content": "hi"}], "hi", {"max_new_tokens": 3}, None)
        started = time.monotonic()
        finished, result = run_with_deadline(lambda: drive(engine, [request]), 120)
        assert finished, "a frozen engine service hung its shard for 120 s"
        assert isinstance(result, EngineError) and str(endpoint) in str(result), result
        # 5 s of silence found it; a watched one then gets 2 s + a probe interval and deadline + 3 s more
        assert time.monotonic() - started < (10 if hang_seconds is None else 20), time.monotonic() - started
        assert ("hang_seconds is null" if hang_seconds is None else "was not replaced within") in str(result), result
    finally:
        threading.Thread(target=engine.close, daemon=True).start()
        server.stop()


def test_item17_an_answer_that_is_not_json_is_retried_then_fails_naming_the_url(monkeypatch):
    """Item 17: an OpenAI-compatible answer that is not JSON failed the shard at once with a
    bare JSONDecodeError; it must be retried as a transient server error, then fail naming the URL."""
    from mirageflow.engines.openai_engine import OpenAIEngine

    calls = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls.append(self.path)
            body = b"<html><body>502 upstream</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = _serve(Proxy)
    monkeypatch.setattr(OpenAIEngine, "retry_base_delay", 0.01)
    url = f"{server.url}/v1"
    engine = OpenAIEngine(_processor("openai", base_url=url, max_retries=2))
    engine.load()
    try:
        from fakes import drive

        request = Request(0, [{"role": "user", "content": "hi"}], None, {"max_new_tokens": 3}, None)
        finished, result = run_with_deadline(lambda: drive(engine, [request]), 60)
        assert finished
        error = result if isinstance(result, BaseException) else getattr(result[0], "error", None)
        assert error is not None and "127.0.0.1" in str(error) and "JSON" in str(error), result
        assert len(calls) == 3  # the first try and max_retries retries
    finally:
        engine.close()
        server.stop()
