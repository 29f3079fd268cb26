"""Shared machinery (not an engine): HTTP helpers, and how engine error messages are classified.

The HTTP helpers (retries with backoff and jitter, error classification, Prometheus text)
are used by ``sglang_server`` and ``openai``; their HTTP client is engines/http_client.py
(a small keep-alive HTTP/1.1 client: the libraries cost too much CPU per request, see
there). The private event loop these engines keep for what is not a request is
``LoopEngine`` (engines/loop.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import socket
from typing import Any, Awaitable, Callable

from mirageflow.engines.base import EngineError, EngineStopped  # noqa: F401
from mirageflow.engines.wire import Completion
from mirageflow.engines.http_client import DeadlineExceeded, HTTPClient, Response, ResponseTooLarge, TransportError, dumps
from mirageflow.errors import RowErrorClass as E
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


# --------------------------------------------------------------------------- HTTP helpers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_context_length_error(message: str) -> bool:
    low = message.lower()
    return any(m in low for m in _CONTEXT_MARKERS)


def error_kind(message: str, default: str = E.INVALID_REQUEST) -> str:
    """The row-error class of an engine's message about one request."""
    if is_context_length_error(message):
        return E.CONTEXT_LENGTH
    low = message.lower()
    if any(m in low for m in _GRAMMAR_MARKERS):
        return E.GRAMMAR_ERROR
    return default


def rejected(rid: int, message: str, default: str = E.INVALID_REQUEST) -> Completion:
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
    client: HTTPClient,
    path: str,
    body: dict,
    *,
    max_retries: int,
    timeout: float,
    base_delay: float,
    max_delay: float,
    what: str,
    on_transport_error: Callable[[], Awaitable[None]] | None = None,
    final: Callable[[Any], bool] | None = None,
) -> Response:
    """POST ``body`` as JSON to ``path`` (under the client's base URL); retry connection
    errors, deadlines, 429, 5xx and a 2xx whose body is not JSON, with backoff.

    Returns the final response (2xx with a JSON body, already decoded: ``response.json()``,
    or a non-retryable status). Each attempt has ``timeout`` seconds in all (connect, send,
    the whole answer), so a frozen server fails the request within (max_retries + 1) x
    timeout plus the backoff. Raises EngineError once ``max_retries`` retries are spent, or
    at once for an answer over the client's size limit. ``on_transport_error`` may raise
    instead of retrying (e.g. when the server process is gone). ``final(response)`` true: a
    retryable status that is this request's own answer (SGLang's 500 for a grammar
    failure) is returned as is.
    """
    data = dumps(body)  # once, whatever the number of attempts
    last = ""
    for attempt in range(max_retries + 1):
        retry_after = None
        try:
            response = await client.post(path, data, timeout=timeout)
        except ResponseTooLarge as e:  # the same answer again on a retry
            raise EngineError(f"{what}: {e}") from None
        except TransportError as e:
            if isinstance(e, DeadlineExceeded):
                last = f"no answer within request_timeout={timeout:g} s"
            else:
                last = f"{type(e).__name__}: {e}"
            if on_transport_error is not None:
                await on_transport_error()
        else:
            status = response.status_code
            if 200 <= status < 300:
                try:
                    response.json()
                    return response
                except ValueError:  # a proxy's HTML page, a truncated answer: a transient server error
                    last = f"HTTP {status} with a body that is not JSON: {response.text.strip()[:200]!r}"
            elif status not in RETRY_STATUS or (final is not None and final(response)):
                return response
            else:
                last = f"HTTP {status}: {error_message(response.content, 200)}"
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
