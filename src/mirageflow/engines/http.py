"""Shared machinery (not an engine): the private event loop of the engines that run one
(SGLang, HTTP servers), HTTP helpers, and how engine error messages are classified.

``LoopEngine`` runs a private asyncio loop in a daemon thread and bridges each
``generate_one`` call into it. The engine's clients (an httpx2 connection pool, SGLang's
tokenizer manager) bind to the first loop that uses them; with a private loop they work
whatever loop, or sequence of ``asyncio.run`` calls, the caller uses. The bridge also lets
``stop()`` (any thread) and a dying server fail every outstanding request at once.

The HTTP helpers (retries with backoff and jitter, error classification, Prometheus text)
are used by ``sglang_server`` and ``openai``; the HTTP client is httpx2 (httpx's maintained
successor, already a dependency of huggingface_hub).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
import re
import socket
import threading
from typing import Any, Awaitable, Callable

from mirageflow.engines.base import Completion, Engine, EngineError, EngineStopped
from mirageflow.redact import redact, redact_text  # noqa: F401 - the engines import them from here
# EngineError and EngineStopped live in base (imported here for the engines' convenience).

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}  # worth another try
FATAL_STATUS = {401, 403, 404}  # wrong key, URL or model: every request would fail
# Messages that say the prompt does not fit, from SGLang (tokenizer manager: "The input (N
# tokens) is longer than the model's context length"; scheduler, srt/managers/utils.py
# validate_input_length: "Input length (N tokens) exceeds the maximum allowed length";
# scheduler.py init_req_max_new_tokens: "Request prompt exceeds the KV memory budget";
# disaggregation: "exceeds the maximum number of tokens"), vLLM and OpenAI.
_CONTEXT_MARKERS = (
    "context length", "context window", "maximum context", "longer than the model",
    "requested token count exceeds", "too many tokens", "context_length_exceeded",
    "exceeds the maximum allowed length", "kv memory budget", "exceeds the maximum number of tokens",
)  # fmt: skip
# Constrained decoding that failed for this request (SGLang: "Grammar accept_token failed:
# ..." with status 500, scheduler_components/batch_result_processor.py; "Failed to compile
# json grammar: ..." for a schema the grammar backend rejects, constrained/grammar_manager.py).
_GRAMMAR_MARKERS = ("grammar",)


class LoopEngine(Engine):
    """An engine whose requests run on a private event loop in a daemon thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()  # outstanding requests, touched only in the loop
        self._failure: BaseException | None = None  # once set, every request fails with it

    # ------------------------------------------------------------------ loop thread

    def _start_loop(self, name: str) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _call(self, coro: Awaitable, timeout: float | None = None) -> Any:
        """Run a coroutine on the engine loop and wait for it (from a synchronous caller)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _close_client_and_loop(self) -> None:
        """Close the pooled HTTP client (when the engine has one) on its loop, then stop the loop."""
        client = getattr(self, "_client", None)
        if client is not None and self._loop is not None:
            try:
                self._call(client.aclose(), timeout=10)
            except Exception:  # noqa: BLE001 - closing goes on
                log.debug("closing the HTTP client failed", exc_info=True)
            self._client = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None:
            return

        async def drain() -> None:  # requests and the library's own background tasks
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        try:
            self._call(drain(), timeout=10)
        except Exception:  # noqa: BLE001 - closing goes on
            log.debug("draining the engine loop failed", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    # ------------------------------------------------------------------ requests

    async def _generate(self, request) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _failure_error(self) -> BaseException:
        """A fresh copy of the failure, so concurrent raisers do not share one traceback."""
        error = copy.copy(self._failure)
        error.__traceback__ = None
        return error

    async def generate_one(self, request):
        return await self._in_engine_loop(self._generate, request)

    async def _in_engine_loop(self, fn, *args) -> Any:
        """``await fn(*args)`` in the engine's loop, from the caller's loop."""
        if self._failure is not None:
            raise self._failure_error()
        if self._loop is None:
            raise RuntimeError(f"{type(self).__name__}: load() was not called, or the engine is closed")
        future = asyncio.run_coroutine_threadsafe(self._tracked(fn, *args), self._loop)
        ok, value = await asyncio.wrap_future(future)
        if not ok:
            raise value
        return value

    async def _tracked(self, fn, *args) -> tuple[bool, Any]:
        """(True, result) or (False, exception): an error never stays unretrieved in the
        engine loop when its caller has gone (e.g. cancelled after a sibling failed)."""
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            if self._failure is not None:
                return False, self._failure_error()
            return True, await fn(*args)
        except asyncio.CancelledError:
            if self._failure is not None:
                return False, self._failure_error()
            raise
        except Exception as e:  # noqa: BLE001 - handed to the caller
            return False, e
        finally:
            self._tasks.discard(task)

    def _fail_all(self, error: BaseException) -> None:
        """From any thread: fail every outstanding and future request with ``error``."""
        if self._failure is None:
            self._failure = error
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: [t.cancel() for t in list(self._tasks)])
            except RuntimeError:  # loop closed meanwhile
                pass

    def queue_depth(self) -> int:
        return len(self._tasks)

    def stop(self) -> None:
        self._fail_all(EngineStopped("engine was stopped"))


# --------------------------------------------------------------------------- HTTP helpers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_context_length_error(message: str) -> bool:
    low = message.lower()
    return any(m in low for m in _CONTEXT_MARKERS)


def error_kind(message: str, default: str = "invalid_request") -> str:
    """The row-error class of an engine's message about one request."""
    if is_context_length_error(message):
        return "context_length"
    low = message.lower()
    if any(m in low for m in _GRAMMAR_MARKERS):
        return "grammar_error"
    return default


def rejected(rid: int, message: str, default: str = "invalid_request") -> Completion:
    """A request the engine refused or aborted (no tokens were generated): a row error."""
    return Completion(rid, "", 0, 0, "abort", error_kind(message, default), message)


def stderr_tail(lines: int = 30) -> str | None:
    """The last lines of this process's stderr when it is a regular file (a job log), else None.

    In-process engines (SGLang's scheduler is a child sharing our stderr) log their
    tracebacks there; a crash message quotes them.
    """
    import os
    import stat

    try:
        path = os.readlink("/proc/self/fd/2")
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    from collections import deque

    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 256 * 1024))
            tail = deque(f, maxlen=lines)
    except OSError:
        return None
    return b"".join(tail).decode("utf-8", "replace").rstrip() or None


def error_message(body: bytes | str, limit: int = 500) -> str:
    """The human part of an error response: OpenAI's {"error": {"message"}}, SGLang's, or the text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:limit]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or data.get("message")
        else:
            msg = err
        if msg:
            return str(msg)[:limit]
    return text.strip()[:limit]


def backoff_delay(attempt: int, base: float, cap: float, retry_after: str | None = None) -> float:
    """Exponential backoff with jitter (half fixed, half random); honours Retry-After seconds."""
    delay = min(cap, base * 2**attempt)
    delay = delay / 2 + random.uniform(0, delay / 2)
    if retry_after:
        try:
            delay = max(delay, min(cap, float(retry_after)))
        except ValueError:  # an HTTP date: ignore
            pass
    return delay


async def post_with_retries(
    client,
    url: str,
    body: dict,
    *,
    max_retries: int,
    timeout: float,
    base_delay: float,
    max_delay: float,
    what: str,
    on_transport_error: Callable[[], Awaitable[None]] | None = None,
    final: Callable[[Any], bool] | None = None,
):
    """POST JSON; retry connection errors, timeouts, 429 and 5xx with backoff.

    Returns the final response (2xx or a non-retryable status). Raises EngineError once
    ``max_retries`` retries are spent. ``on_transport_error`` may raise instead of retrying
    (e.g. when the server process is gone). ``final(response)`` true: a retryable status
    that is this request's own answer (SGLang's 500 for a grammar failure) is returned as is.
    """
    import httpx2

    last = ""
    for attempt in range(max_retries + 1):
        retry_after = None
        try:
            response = await asyncio.wait_for(client.post(url, json=body), timeout)
        except (httpx2.TransportError, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError):
                last = f"no answer within request_timeout={timeout:g} s"
            else:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if on_transport_error is not None:
                await on_transport_error()
        else:
            if response.status_code not in RETRY_STATUS or (final is not None and final(response)):
                return response
            last = f"HTTP {response.status_code}: {error_message(response.content, 200)}"
            retry_after = response.headers.get("retry-after")
        if attempt == max_retries:
            break
        delay = backoff_delay(attempt, base_delay, max_delay, retry_after)
        log.debug("%s: %s; retry %d/%d in %.2f s", what, last, attempt + 1, max_retries, delay)
        await asyncio.sleep(delay)
    raise EngineError(f"{what}: gave up after {max_retries} retries ({max_retries + 1} attempts); last error: {last}")


_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str, names: list[str]) -> dict[str, float | None]:
    """The named metrics from Prometheus text, each summed over its label sets (None if absent)."""
    found: dict[str, float | None] = {n: None for n in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m or m.group(1) not in found:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        found[m.group(1)] = (found[m.group(1)] or 0.0) + value
    return found
