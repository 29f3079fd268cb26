"""Shared machinery (not an engine): the engines' side of HTTP, and how engine error messages
are classified.

The transport (the client, the retry policy, classification of statuses, credentials) is
the transport room (transport/); here: ``post_with_retries`` (its retries as engine
errors), the row-error class of an engine's message, Prometheus text. The private event
loop these engines keep for what is not a request is ``LoopEngine`` (engines/loop.py).
"""

from __future__ import annotations

import logging
import re
import socket
from typing import Any, Awaitable, Callable

from mirageflow.engines.base import EngineError, EngineStopped  # noqa: F401
from mirageflow.engines.wire import Completion
from mirageflow.transport.http_client import HTTPClient, Response, ResponseTooLarge, TransportError, dumps
from mirageflow.transport.rate_limit import RateLimiter
from mirageflow.transport.retry import PERMANENT_STATUS, RetryPolicy, with_retries
from mirageflow.transport.retry import RETRY_STATUS, backoff_delay, error_message  # noqa: F401 - the engines import them from here
from mirageflow.errors import RowErrorClass as E
from mirageflow.redact import redact, redact_text  # noqa: F401 - the engines import them from here
# EngineError and EngineStopped live in base (imported here for the engines' convenience).

log = logging.getLogger(__name__)

FATAL_STATUS = PERMANENT_STATUS  # wrong key, URL or model: every request would fail (transport/retry.py classifies)
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
    limiter: RateLimiter | None = None,
    tokens: int = 0,
    spend=None,
    cost_estimate: float = 0.0,
) -> Response:
    """POST ``body`` as JSON to ``path`` (under the client's base URL) under the transport's
    one retry policy (transport/retry.py): connection errors, deadlines, 429, 5xx and a 2xx
    whose body is not JSON are retried with backoff.

    Returns the final response (2xx with a JSON body, already decoded: ``response.json()``,
    or a status that is not retried: the engine reads 401/403/404 itself). Each attempt has
    ``timeout`` seconds in all, so a frozen server fails the request within (max_retries +
    1) x timeout plus the backoff. Raises EngineError once ``max_retries`` retries are spent,
    or at once for an answer over the client's size limit. ``on_transport_error`` may raise
    instead of retrying (e.g. when the server process is gone). ``final(response)`` true: a
    retryable status that is this request's own answer (SGLang's 500 for a grammar
    failure) is returned as is. ``limiter``: each attempt is paced under the processor's
    limits (transport/rate_limit.py), ``tokens`` its estimate; ``spend``: each attempt holds
    ``cost_estimate`` dollars in the run's spend ledger first (transport/spend.py: BudgetExceeded
    past the budget, an EngineError carrying it as its context).
    """
    data = dumps(body)  # once, whatever the number of attempts
    policy = RetryPolicy(max_retries, base_delay, max_delay, timeout, "request_timeout")
    try:
        return await with_retries(
            lambda: client.request("POST", path, data, timeout=timeout), policy=policy, what=what, json_answer=True,
            on_transport_error=on_transport_error, final=final, limiter=limiter, tokens=tokens,
            spend=spend, cost_estimate=cost_estimate,
        )  # fmt: skip
    except TransportError as e:  # retries spent, or an answer over the size limit
        raise EngineError(f"{what}: {e}" if isinstance(e, ResponseTooLarge) else str(e)) from None


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
