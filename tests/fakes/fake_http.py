"""A real HTTP server on 127.0.0.1 that speaks like SGLang's, with scripted trouble.

Endpoints: ``GET /health_generate`` (503 while "starting", then 200), ``POST /generate``
(SGLang native: ``{"text", "sampling_params"}`` -> ``{"text", "meta_info"}``),
``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI), ``GET /metrics``
(Prometheus text, when metrics are on), ``GET /get_server_info``.

Trouble: ``latency`` per request; ``hold_until`` (hold requests until that many were in
flight at once, to observe a client's window deterministically); ``unhealthy_for`` seconds of 503 at start;
``never_healthy``; ``plan``, a list consumed one entry per generation request ("ok", an
HTTP status such as "429"/"503"/"400"/"401", "drop" to close the connection without an
answer, or "html" for a 200 whose body is an HTML page, as a proxy in the way answers);
a query string on the path is recorded (``query``) and ignored for routing; ``crash_after`` (script mode only: the process exits with ``crash_code`` on the
next generation request after that many were answered). A prompt containing ``TOO_LONG``
gets SGLang's 400 context-length error; an OpenAI request containing ``USAGE_NEGATIVE``
gets ``usage.completion_tokens: -12000``. ``/generate`` with ``image_data`` needs one
``<image>`` in the text per image (data URIs), each adding 15 prompt tokens; chat content
parts must be OpenAI's (text, image_url), else 400. OpenAI answers honour ``n`` (choices
0..n-1, usage for all of them; ``ignore_n``: one choice, a server without it), refuse the
seeds in ``reject_seeds`` with a 400, and with ``seed_in_text`` end each choice with the seed
that drew it, choice i of a request with seed s drawing with s + i as vLLM does.

A provider's rate limits (``rate_limits``: a ``ProviderLimits`` of requests and tokens per
window, short windows for tests): each limit is a bucket of that size refilled continuously
(as OpenAI's: its reset header is the time until full). An OpenAI request takes one request
and its estimate of tokens (the prompt's tokens as counted here plus ``max_tokens`` per
choice) when it arrives, and the estimate is corrected to the answer's usage; one that does
not fit is a 429 with OpenAI's ``rate_limit_exceeded`` body, a Retry-After (whole seconds
until it would fit) and, on every answer, ``x-ratelimit-limit/remaining/reset-requests``
and ``-tokens`` (durations as OpenAI writes them: ``1m30s``, ``250ms``). ``rate_limited``
counts the 429s, ``admitted`` the requests let through (``admitted_at``: when), ``usage_tokens``
their usage.

``/generate`` follows sglang 0.5.23 (srt/entrypoints/http_server.py ``generate_request``):
a body outside the API contract (an unknown sampling parameter, a json_schema that is not
a string) is a 400 ``{"error": "<contract message>"}`` (api_contract.py); a ValueError is a
400 ``{"error": {"message"}}``; the HTTPException of a scheduler abort keeps its status
with FastAPI's ``{"detail"}`` (``GRAMMAR_FAIL`` in the text: 500 "Grammar accept_token
failed"); ``input_ids`` may replace ``text``. ``json_schema`` and ``ebnf`` are answered as
fake_grammar.py says (``{"answer": "yes"}``, or the tail of it an ebnf grammar accepts). ``/server_info`` (``/get_server_info`` is
deprecated) reports the version.

Used in a thread by tests (``FakeServer(...).start()``) and as the core of
``fake_sglang_server.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

try:
    from fakes.fake_grammar import GrammarFailure, constrained_answer
except ImportError:  # run as a script from tests/fakes (fake_sglang_server.py)
    from fake_grammar import GrammarFailure, constrained_answer

_FACTS = json.loads(Path(__file__).with_name("sglang_facts.json").read_text())

CONTEXT_ERROR = "The input (5000 tokens) is longer than the model's context length (2048 tokens)."


@dataclass(frozen=True)
class ProviderLimits:
    """A provider's limits: ``requests`` and ``tokens`` (input + output) per ``seconds`` (None: no limit)."""

    requests: int | None = None
    tokens: int | None = None
    seconds: float = 60.0


class _Bucket:
    """``size`` units refilled at ``size`` per ``seconds``, continuously."""

    def __init__(self, size: int, seconds: float):
        self.size, self.rate = size, size / seconds
        self.level, self.at = float(size), time.monotonic()

    def refill(self, now: float) -> None:
        self.level, self.at = min(self.size, self.level + (now - self.at) * self.rate), now

    def wait(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.rate)

    def headers(self, name: str) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{name}": str(self.size),
            f"x-ratelimit-remaining-{name}": str(max(0, int(self.level))),
            f"x-ratelimit-reset-{name}": openai_duration((self.size - self.level) / self.rate),
        }


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.3f}".rstrip("0").rstrip(".") + "s" if minutes else f"{rest:.3f}".rstrip("0").rstrip(".") + "s"


@dataclass
class Behaviour:
    latency: float = 0.0
    unhealthy_for: float = 0.0
    never_healthy: bool = False
    plan: list[str] = field(default_factory=list)
    crash_after: int | None = None
    crash_code: int = 7
    # script mode only: ("kill", n) SIGKILLs the process, ("freeze", n) SIGSTOPs it, on the next
    # generation request after n answers (a death the process cannot report)
    death: tuple[str, int] | None = None
    # append a JSON line per generation request asked and answered (pid, prompt, seed, n) to this file
    request_log: str | None = None
    enable_metrics: bool = True
    model: str = "fake-model"
    allow_exit: bool = False  # only a stand-in process may exit
    hold_until: int = 0  # hold generation requests until this many were in flight at once (max 5 s)
    # chat answers carry this as message.reasoning_content, as SGLang does when launched with
    # --reasoning-parser (sglang/srt/entrypoints/openai/protocol.py: ChatMessage.reasoning_content)
    reasoning: str | None = None
    # the field it comes in: SGLang's reasoning_content, or vLLM's reasoning (vLLM 0.32 sends
    # only that one: vllm/entrypoints/openai/chat_completion/protocol.py ChatMessage)
    reasoning_field: str = "reasoning_content"
    reasoning_only: bool = False  # content null beside the reasoning: an answer cut while thinking
    # OpenAI answers whose body "seed" is in this set are HTTP 400 (a per-sample failure)
    reject_seeds: frozenset = frozenset()
    # OpenAI answers say which seed drew them (" s=<seed>"), choice i of a request with n and
    # seed s drawing with s + i as vLLM does (vllm/v1/engine/parallel_sampling.py)
    seed_in_text: bool = False
    ignore_n: bool = False  # one choice whatever the request's n (a server without n)
    # "vllm": /health, /version and vLLM's metric names (vllm/v1/metrics/loggers.py), which
    # count a request's prompt once per choice; "sglang": SGLang's
    flavour: str = "sglang"
    rate_limits: ProviderLimits | None = None  # a provider's limits on the OpenAI endpoints


class _ListeningServer(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: a shard opening 64 connections at once overflows
    # it, and Linux then drops handshakes it has already answered, so some requests are
    # never read (seen as "no answer within request_timeout"). Real servers (uvicorn, vLLM,
    # SGLang) listen with a backlog of 2048.
    request_queue_size = 1024


class LocalHTTPServer:
    """A fake's HTTP server on this machine, served by a thread of this process (the part
    every fake shares): ``listen`` in ``__init__``, then ``start()`` / ``url`` / ``stop()``."""

    def listen(self, host: str, port: int, handler) -> None:
        self.httpd = _ListeningServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeServer(LocalHTTPServer):
    def __init__(self, behaviour: Behaviour | None = None, host: str = "127.0.0.1", port: int = 0):
        self.behaviour = behaviour or Behaviour()
        self.records: list[dict] = []
        self.health_statuses: list[int] = []
        self.lock = threading.Lock()
        self.peak_reached = threading.Condition(self.lock)
        self.started = time.monotonic()
        self.answered = 0
        self.in_flight = self.peak_in_flight = 0
        self.prompt_tokens = self.generation_tokens = 0
        # as vLLM counts: a request's prompt once per choice; a prompt asked before is a cache hit
        # (whole prompts only; the choices of one request are computed together, no hit)
        self.choice_prompt_tokens = self.cache_hits = self.answered_choices = 0
        self.seen_prompts: set[str] = set()
        limits = self.behaviour.rate_limits
        self.buckets = {
            name: _Bucket(size, limits.seconds) for name, size in (("requests", limits and limits.requests), ("tokens", limits and limits.tokens)) if size
        }  # fmt: skip
        self.rate_limited = self.admitted = self.usage_tokens = 0
        self.admitted_at: list[float] = []  # time.monotonic() of each request let through
        self.listen(host, port, _handler(self))

    def admit(self, estimate: int) -> tuple[float, dict[str, str]]:
        """Take a request and ``estimate`` tokens from the buckets: (0, headers), or (seconds
        until they would fit, headers) and nothing taken."""
        with self.lock:
            now = time.monotonic()
            cost = {"requests": 1, "tokens": estimate}
            for bucket in self.buckets.values():
                bucket.refill(now)
            wait = max((b.wait(cost[name]) for name, b in self.buckets.items()), default=0.0)
            if wait > 0:
                self.rate_limited += 1
            else:
                for name, bucket in self.buckets.items():
                    bucket.level -= cost[name]
                self.admitted += 1
                self.admitted_at.append(now)
            return wait, self.limit_headers()

    def correct(self, estimate: int, used: int) -> dict[str, str]:
        """The tokens bucket charged ``used`` for a request admitted at ``estimate``; the headers then."""
        with self.lock:
            if "tokens" in self.buckets:
                self.buckets["tokens"].refill(time.monotonic())
                self.buckets["tokens"].level -= used - estimate
            self.usage_tokens += used
            return self.limit_headers()

    def limit_headers(self) -> dict[str, str]:
        headers = {}
        for name, bucket in self.buckets.items():
            headers.update(bucket.headers(name))
        return headers

    def next_action(self) -> str:
        with self.lock:
            return self.behaviour.plan.pop(0) if self.behaviour.plan else "ok"

    def healthy(self) -> bool:
        b = self.behaviour
        return not b.never_healthy and time.monotonic() - self.started >= b.unhealthy_for

    def metrics_text(self) -> str:
        if self.behaviour.flavour == "vllm":
            return self.vllm_metrics_text()
        m = self.behaviour.model
        lines = []
        for name, kind, value in (
            ("sglang:prompt_tokens_total", "counter", self.prompt_tokens),
            ("sglang:generation_tokens_total", "counter", self.generation_tokens),
            ("sglang:num_requests_total", "counter", self.answered),
            ("sglang:cached_tokens_total", "counter", 0),
            ("sglang:num_retracted_requests_total", "counter", 0),
            ("sglang:num_running_reqs", "gauge", self.in_flight),
            ("sglang:num_queue_reqs", "gauge", 0),
        ):
            lines += [f"# HELP {name} fake", f"# TYPE {name} {kind}"]
            # two label sets (as with two TP ranks): the scraper must sum them
            lines.append(f'{name}{{model_name="{m}",tp_rank="0"}} {float(value)}')
            lines.append(f'{name}{{model_name="{m}",tp_rank="1"}} 0.0')
        lines.append('sglang:gen_throughput{model_name="%s"} 1.0' % m)
        return "\n".join(lines) + "\n"

    def vllm_metrics_text(self) -> str:
        m, lines = self.behaviour.model, []
        for name, kind, value in (
            ("vllm:prompt_tokens", "counter", self.choice_prompt_tokens),
            ("vllm:generation_tokens", "counter", self.generation_tokens),
            ("vllm:prefix_cache_queries", "counter", self.choice_prompt_tokens),
            ("vllm:prefix_cache_hits", "counter", self.cache_hits),
            ("vllm:num_preemptions", "counter", 0),
            ("vllm:num_requests_running", "gauge", self.in_flight),
            ("vllm:num_requests_waiting", "gauge", 0),
        ):
            lines += [f"# HELP {name} fake", f"# TYPE {name} {kind}"]
            suffix = "_total" if kind == "counter" else ""
            lines.append(f'{name}{suffix}{{engine="0",model_name="{m}"}} {float(value)}')
            if kind == "counter":
                lines.append(f'{name}_created{{engine="0",model_name="{m}"}} 1.7e9')
        lines += ["# TYPE vllm:request_success counter"]  # one label set per finish reason
        lines.append(f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{m}"}} {float(self.answered_choices)}')
        lines.append(f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{m}"}} 0.0')
        return "\n".join(lines) + "\n"


_log_lock = threading.Lock()


def this_starts_death(env, prefix: str) -> tuple[str, int] | None:
    """A stand-in server's death, scripted per start: this start's entry of ``<prefix>_DEATHS``
    ("kill:n", "freeze:n", "exit" or "serve"; starts counted in the file ``<prefix>_STARTS``)."""
    if not env.get(f"{prefix}_DEATHS"):
        return None
    with open(env[f"{prefix}_STARTS"], "a+") as f:
        f.seek(0)
        k = len(f.read().splitlines())
        f.write(f"{os.getpid()}\n")
    plan = env[f"{prefix}_DEATHS"].split(",")
    if k >= len(plan) or plan[k] == "serve":
        return None
    how, _, after = plan[k].partition(":")
    return how, int(after or 0)


def _log_request(path: str | None, event: str, body: dict) -> None:
    """One line of ``Behaviour.request_log``: who (pid) was asked or answered what."""
    if path is None:
        return
    messages = body.get("messages")
    prompt = messages[-1].get("content") if messages else body.get("prompt", body.get("text"))
    line = json.dumps({"pid": os.getpid(), "event": event, "prompt": prompt, "seed": body.get("seed"), "n": body.get("n", 1)})
    with _log_lock, open(path, "a") as f:
        f.write(line + "\n")


IMAGE_TOKEN = "<image>"
TOKENS_PER_IMAGE = 16


def _valid_part(part) -> bool:
    """An OpenAI chat content part: text, or an image_url whose url is a data: or http(s) URL."""
    if not isinstance(part, dict):
        return False
    if part.get("type") == "text":
        return isinstance(part.get("text"), str)
    url = (part.get("image_url") or {}).get("url") if part.get("type") == "image_url" else None
    return isinstance(url, str) and url.startswith(("data:image/", "http://", "https://"))


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def _handler(server: FakeServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet; the stand-in logs what matters
            pass

        def _send(self, status: int, body, content_type: str = "application/json", headers: dict | None = None) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if status == 429 and not (headers and "Retry-After" in headers):
                self.send_header("Retry-After", "0")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                self.close_connection = True

        def do_GET(self):
            if self.path == "/health":  # vLLM's readiness; SGLang's liveness (the probe of a hang watch)
                self._send(200 if server.healthy() else 503, "")
            elif self.path == "/version":
                self._send(200, {"version": "0.32.0+fake"})
            elif self.path == "/health_generate":
                status = 200 if server.healthy() else 503
                server.health_statuses.append(status)
                self._send(status, {} if status == 200 else {"error": "starting"})
            elif self.path == "/metrics":
                if server.behaviour.enable_metrics:
                    self._send(200, server.metrics_text(), "text/plain; version=0.0.4")
                else:
                    self._send(404, {"detail": "Not Found"})
            elif self.path in ("/server_info", "/get_server_info"):
                with server.lock:  # what tests of a stand-in process need to see
                    generates = [r["body"] for r in server.records if r["path"] == "/generate"]
                self._send(
                    200,
                    {
                        "version": "0.5.23+fake",
                        "peak_in_flight": server.peak_in_flight,
                        "answered": server.answered,
                        "generate_requests": len(generates),
                        "input_ids": [b.get("input_ids") for b in generates],
                        "texts": [b.get("text") for b in generates],
                        "image_data": [b.get("image_data") for b in generates],
                    },
                )
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            self.path, _, query = self.path.partition("?")
            with server.lock:
                server.records.append({"path": self.path, "query": query, "headers": dict(self.headers), "body": body})
            if self.path not in ("/generate", "/v1/chat/completions", "/v1/completions"):
                return self._send(404, {"detail": "Not Found"})
            b = server.behaviour
            if b.crash_after is not None and server.answered >= b.crash_after and b.allow_exit:
                print("fake sglang: CUDA error: an illegal memory access was encountered", flush=True)
                os._exit(b.crash_code)
            _log_request(b.request_log, "asked", body)
            if b.death is not None and server.answered >= b.death[1] and b.allow_exit:
                print(f"fake: {b.death[0]} after {server.answered} answers", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if b.death[0] == "kill" else signal.SIGSTOP)
            action = server.next_action()
            if action == "drop":
                self.close_connection = True
                return
            if action == "html":
                return self._send(200, "<html><body>502 Bad Gateway (proxy)</body></html>", "text/html")
            if action != "ok":
                status = int(action)
                return self._send(status, {"object": "error", "message": f"fake {status}", "code": status})
            limited = server.buckets and self.path != "/generate"
            if limited:
                estimate = self._estimate(body)
                wait, headers = server.admit(estimate)
                if wait > 0:
                    error = {"message": "Rate limit reached (fake)", "type": "requests", "code": "rate_limit_exceeded"}
                    return self._send(429, {"error": error}, headers={**headers, "Retry-After": str(math.ceil(wait))})
            with server.lock:
                server.in_flight += 1
                server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
                server.peak_reached.notify_all()
                server.peak_reached.wait_for(lambda: server.peak_in_flight >= b.hold_until, timeout=5)
            try:
                if b.latency:
                    time.sleep(b.latency)
                if self.path == "/generate":
                    status, answer = self._generate(body)
                else:
                    status, answer = self._openai(body)
            finally:
                with server.lock:
                    server.in_flight -= 1
            if limited:
                used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] if status == 200 else 0
                return self._send(status, answer, headers=server.correct(estimate, used))
            self._send(status, answer)
            if status == 200:
                _log_request(b.request_log, "answered", body)

        def _estimate(self, body: dict) -> int:
            """A request's tokens as the provider counts them on arrival: its prompt's, and max_tokens per choice."""
            chat = self.path == "/v1/chat/completions"
            source = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
            return len(source.split()) + int(body.get("max_tokens") or 0) * int(body.get("n") or 1)

        def _count(self, prompt: int, completion: int) -> None:
            with server.lock:
                server.answered += 1
                server.prompt_tokens += prompt
                server.generation_tokens += completion

        def _generate(self, body: dict):
            text, ids, params = body.get("text"), body.get("input_ids"), body.get("sampling_params") or {}
            unknown = sorted(set(params) - set(_FACTS["generate_sampling_params"]))
            if unknown:  # api_contract.generate_contract_error
                return 400, {"error": _FACTS["generate_unknown_sampling_error"].format(name=unknown[0])}
            if "json_schema" in params and not isinstance(params["json_schema"], str):
                return 400, {"error": "invalid type: map, expected a string"}
            if (text is None) == (ids is None):
                return 400, {"error": {"message": "Either text or input_ids should be provided."}}
            if ids is not None:
                if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
                    return 400, {"error": "invalid type: expected a sequence of integers"}
                text = " ".join(f"t{i}" for i in ids)
                p = len(ids)
            elif not isinstance(text, str):
                return 400, {"error": {"message": "text must be a string"}}
            else:
                p = len(text.split())
            images = body.get("image_data")
            if images is not None:  # SGLang's native VLM request: placeholders match images one to one
                images = [images] if isinstance(images, str) else images
                if text.count(IMAGE_TOKEN) != len(images) or not all(str(i).startswith("data:image/") for i in images):
                    return 400, {"error": {"message": f"fake: {text.count(IMAGE_TOKEN)} placeholders for {len(images)} image_data items"}}
                p += len(images) * (TOKENS_PER_IMAGE - 1)
            if "SCHED_TOO_LONG" in text:  # scheduler abort with status 400 -> ValueError -> 400
                return 400, {
                    "error": {
                        "message": "Input length (5000 tokens) exceeds the maximum allowed length (4096 tokens). Use a shorter input or enable --allow-auto-truncate."
                    }
                }
            if "TOO_LONG" in text:
                return 400, {"error": {"message": CONTEXT_ERROR}}
            if "GRAMMAR_FAIL" in text:  # HTTPException(500) -> FastAPI's {"detail"}
                return 500, {"detail": "Grammar accept_token failed: token 1234 is not accepted by the grammar"}
            limit = int(params.get("max_new_tokens", 128))
            n = min(limit, 1 + sum(map(ord, text)) % 7)
            try:
                out = constrained_answer(params, '{"answer": "yes"}') if "json_schema" in params or "ebnf" in params else _words(n)
            except ValueError as e:  # an EBNF that does not compile
                return 400, {"error": {"message": str(e)}}
            except GrammarFailure as e:
                return 500, {"detail": str(e)}
            self._count(p, n)
            reason = {"type": "length", "length": n} if n >= limit else {"type": "stop", "matched": 2}
            return 200, {"text": out, "meta_info": {"id": "x", "finish_reason": reason, "prompt_tokens": p, "completion_tokens": n}}

        def _openai(self, body: dict):
            chat = self.path == "/v1/chat/completions"
            for message in body.get("messages") or [] if chat else []:
                if isinstance(message.get("content"), list) and not all(_valid_part(p) for p in message["content"]):
                    return 400, {
                        "object": "error",
                        "message": f"invalid content part in {message['content']}",
                        "type": "BadRequestError",
                        "code": 400,
                    }
            source = json.dumps(body.get("messages")) if chat else body.get("prompt", "")
            if "TOO_LONG" in source:
                return 400, {"object": "error", "message": CONTEXT_ERROR, "type": "BadRequestError", "code": 400}
            if body.get("seed") in server.behaviour.reject_seeds:
                return 400, {"object": "error", "message": f"fake: seed {body['seed']} refused", "type": "BadRequestError", "code": 400}
            limit = body.get("max_tokens") or 128
            json_mode = (body.get("response_format") or {}).get("type") == "json_schema"
            p = len(source.split())
            choices, generated = [], 0
            for i in range(1 if server.behaviour.ignore_n else int(body.get("n") or 1)):  # the API's n: choices 0..n-1, usage for all
                n = min(limit, 3 if json_mode else 1 + len(source) % 7)
                out = '{"answer": "yes"}' if json_mode else _words(n)
                if server.behaviour.seed_in_text and not json_mode:
                    out += f" s={body['seed'] + i}" if body.get("seed") is not None else f" draw={os.urandom(4).hex()}"
                generated += n
                choice = {"index": i, "finish_reason": "length" if n >= limit else "stop"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": None if server.behaviour.reasoning_only else out}
                    if server.behaviour.reasoning is not None:
                        choice["message"][server.behaviour.reasoning_field] = server.behaviour.reasoning
                else:
                    choice["text"] = out
                choices.append(choice)
            self._count(p, generated)
            with server.lock:
                choices_n = len(choices)
                server.choice_prompt_tokens += p * choices_n
                server.answered_choices += choices_n
                server.cache_hits += p * choices_n if source in server.seen_prompts else 0  # not among one request's choices
                server.seen_prompts.add(source)
            usage = {"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated}
            if "USAGE_NEGATIVE" in source:  # a server's usage that is no count
                usage["completion_tokens"] = -12000
            return 200, {
                "id": "cmpl-fake",
                "object": "chat.completion" if chat else "text_completion",
                "model": body.get("model"),
                "choices": choices,
                "usage": usage,
            }

    return Handler


if __name__ == "__main__":  # pragma: no cover - a quick manual server
    s = FakeServer(port=int(sys.argv[1]) if len(sys.argv) > 1 else 0).start()
    print(s.url, flush=True)
    s.thread.join()
