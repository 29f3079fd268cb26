"""The one retry policy of every HTTP call (see transport/__init__.py).

Each answer is classified once (``classify``): ``ok`` (2xx), ``transient`` (a status in
``RETRY_STATUS``, a connection that failed, no whole answer within the attempt's deadline:
worth another try), ``permanent`` (``PERMANENT_STATUS``: a wrong key, a forbidden
resource, an id or URL the server does not know: the same answer on every try) or
``refused`` (any other status: this request's own answer, returned to the caller).
``send_with_retries`` retries transient failures ``RetryPolicy.retries`` times, each after
``backoff_delay`` (exponential, half of it random, at most ``max_delay``; a Retry-After in
seconds is honoured up to ``max_delay``), so one call takes at most
``(retries + 1) x timeout + retries x max_delay``, plus, with a ``limiter``
(transport/rate_limit.py), the waits for each attempt's slot under the processor's limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any, Awaitable, Callable, NamedTuple

from mirageflow.transport.http_client import DeadlineExceeded, HTTPClient, Response, ResponseTooLarge, TransportError
from mirageflow.transport.rate_limit import RateLimiter
from mirageflow.transport.spend import SpendLedger

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})  # worth another try
PERMANENT_STATUS = frozenset({401, 403, 404})  # a wrong key, URL, model or id: every try answers the same

OK, TRANSIENT, PERMANENT, REFUSED = "ok", "transient", "permanent", "refused"


def classify(status: int) -> str:
    """What an HTTP status means for a retry: ok, transient, permanent or refused."""
    if 200 <= status < 300:
        return OK
    if status in RETRY_STATUS:
        return TRANSIENT
    if status in PERMANENT_STATUS:
        return PERMANENT
    return REFUSED


class RetriesExhausted(TransportError):
    """Transient failures on every attempt: an outage. ``last_error``: the last attempt's
    TransportError (no whole answer), else None (it answered a transient status)."""

    def __init__(self, message: str, last_error: TransportError | None = None):
        super().__init__(message)
        self.last_error = last_error


class PermanentStatus(TransportError):
    """An answer in PERMANENT_STATUS (401, 403, 404): retrying would get the same."""

    def __init__(self, message: str, status: int, detail: str):
        super().__init__(message)
        self.status, self.detail = status, detail


class RetryPolicy(NamedTuple):  # a tuple: made per request by the engines, at no cost
    retries: int  # attempts after the first
    base_delay: float  # seconds before the first retry (before jitter)
    max_delay: float  # cap of one wait (Retry-After included)
    timeout: float | None  # seconds for one attempt, all of it (connect, send, the whole answer)
    timeout_name: str = "timeout"  # the setting that gave ``timeout``, for messages

    def bound_seconds(self) -> float:
        """The longest one call can take."""
        return (self.retries + 1) * (self.timeout or 0.0) + self.retries * self.max_delay


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


async def send_with_retries(
    client: HTTPClient,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    policy: RetryPolicy,
    what: str,
    content_type: str | None = None,
    **kw,
) -> Response:
    """``method path`` on ``client`` (its origin, its credentials) under ``policy``: ``with_retries``."""

    def attempt() -> Awaitable[Response]:
        return client.request(method, path, body, timeout=policy.timeout, content_type=content_type)

    return await with_retries(attempt, policy=policy, what=what, **kw)


async def with_retries(
    attempt: Callable[[], Awaitable[Response]],
    *,
    policy: RetryPolicy,
    what: str,
    json_answer: bool = False,
    permanent_raises: bool = False,
    on_transport_error: Callable[[], Awaitable[None]] | None = None,
    final: Callable[[Any], bool] | None = None,
    limiter: RateLimiter | None = None,
    tokens: int = 0,
    spend: SpendLedger | None = None,
    cost_estimate: float = 0.0,
) -> Response:
    """``attempt()`` (one request, bounded by ``policy.timeout``) until it is not transient,
    at most ``policy.retries`` times more. Returns a 2xx answer (with ``json_answer``: one
    whose body is JSON, already decoded; a 2xx that is not JSON counts as transient: a
    proxy's page, a truncated answer) or a refused one (a status the caller reads; also a
    permanent one unless ``permanent_raises``, and a transient one that
    ``final(response)`` says is this request's own answer). Raises PermanentStatus (with
    ``permanent_raises``), RetriesExhausted once the retries are spent, ResponseTooLarge at
    once (the same answer again on a retry). ``on_transport_error`` may raise instead of
    retrying (the server process is gone). ``limiter``: each attempt waits for its slot under
    the processor's limits (``tokens``: the request's estimate) and the limiter learns from
    its answer (usage, rate-limit headers, Retry-After). ``spend``: each attempt first holds
    ``cost_estimate`` dollars in the run's spend ledger (transport/spend.py), raising
    BudgetExceeded, unsent, when that would pass the run's budget; its answer settles it."""
    last, last_error = "", None
    for n in range(policy.retries + 1):
        retry_after, last_error = None, None
        held = await spend.reserve(cost_estimate) if spend is not None else 0.0
        response, sent = None, False
        try:
            ticket = await limiter.acquire(tokens) if limiter is not None else None
            sent = True
            response = await attempt()
        except ResponseTooLarge:
            raise
        except TransportError as e:
            last_error = e
            if isinstance(e, DeadlineExceeded):
                last = f"no answer within {policy.timeout_name}={policy.timeout:g} s"
            else:
                last = f"{type(e).__name__}: {e}"
            if on_transport_error is not None:
                await on_transport_error()
        else:
            if limiter is not None:
                limiter.settle(ticket, response)
            status = response.status_code
            verdict = classify(status)
            if verdict == OK:
                if not json_answer:
                    return response
                try:
                    response.json()
                    return response
                except ValueError:
                    last = f"HTTP {status} with a body that is not JSON: {response.text.strip()[:200]!r}"
            elif verdict == PERMANENT and permanent_raises:
                detail = error_message(response.content)
                raise PermanentStatus(f"{what}: HTTP {status}: {detail}", status, detail)
            elif verdict != TRANSIENT or (final is not None and final(response)):
                return response
            else:
                last = f"HTTP {status}: {error_message(response.content, 200)}"
                retry_after = response.headers.get("retry-after")
        finally:
            if spend is not None:  # the hold becomes the answer's cost (nothing, when nothing was sent)
                spend.settle(held, response, sent)
        if n == policy.retries:
            break
        delay = backoff_delay(n, policy.base_delay, policy.max_delay, retry_after)
        log.debug("%s: %s; retry %d/%d in %.2f s", what, last, n + 1, policy.retries, delay)
        await asyncio.sleep(delay)
    raise RetriesExhausted(
        f"{what}: gave up after {policy.retries} retries ({policy.retries + 1} attempts); last error: {last}", last_error
    )
