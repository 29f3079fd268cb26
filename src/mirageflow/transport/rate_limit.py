"""Pacing requests under a provider's limits: ``processors[].max_requests_per_minute`` and
``max_tokens_per_minute``, and what the provider's answers say is left.

``RateLimiter.acquire(tokens)`` waits until a request of that many tokens may go;
``settle(ticket, response)`` learns from its answer. ``with_retries`` (transport/retry.py, the
one retry policy) calls both around every attempt, so a retry is paced like a first try.

- Pace: GCRA (the "theoretical arrival time" form of a leaky bucket) with no burst, one
  number per limit: a request may go at ``tat``; it moves ``tat`` on by its cost over the
  rate (1 request; its tokens). Sending reserves the slot at once and sleeps until it, so
  requests queued behind the limit go out evenly at exactly the limit, never faster. A
  request cancelled while it waits (a shard stopping) gives its slot back; the file keeps
  the limits it was paced for, and other limits (an edited config) start it afresh.
- Tokens: input + output. Before sending, the request's own estimate (the engine's:
  its prompt's characters / 4 plus its ``max_new_tokens``, see engines/openai_engine.py);
  after, the answer's ``usage`` corrects it (``tat`` moves by the difference); a 429's
  tokens are given back (the provider counted none).
- The provider's headers tighten the pace, never loosen it: ``x-ratelimit-remaining-requests``
  r with ``x-ratelimit-reset-requests`` s (OpenAI's durations: ``6m0s``, ``20ms``; likewise
  ``-tokens``), or Anthropic's ``anthropic-ratelimit-requests-remaining`` with
  ``anthropic-ratelimit-requests-reset`` (an RFC 3339 time; likewise ``-tokens``) mean no more than r in the next s: until then requests are spaced s / r
  apart (r = 0: none before s has passed). A 429's or 503's ``Retry-After`` pauses every
  request until then (the retry policy also waits it for the refused request itself).
- Shared by the shards of a run (``shared_file``: ``<state_dir>/rate_limits/<processor>.json``):
  the numbers live in that file (transport/shared_state.py), read and written under an fcntl lock for each request,
  so all the shards that run at once, on this machine or on the cluster's nodes, draw on
  one budget, whatever their number; a shard alone gets the whole of it. The file holds
  wall-clock times (``time.time()``: the nodes' clocks are assumed in step, as NTP keeps
  them). Without a file (``mmirage preview``, a limiter made by a test) the numbers are
  this process's.

Why no library: aiolimiter (a leaky bucket) and limits' memory storage pace one process;
limits shares its counters only through a server (Redis, Memcached, MongoDB), which a
cluster run does not have; pyrate-limiter's SQLite bucket, the one kept in a file, keeps a
log of timestamps (a row per unit of weight: per token, at millions of tokens a minute),
and SQLite over NFS (where a cluster's state_dir lives) is unsafe. What the shards need is
two numbers per limit in a locked file: the few lines below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from mirageflow.transport.shared_state import SharedState

log = logging.getLogger(__name__)

REQUESTS, TOKENS = "requests", "tokens"
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)(ms|h|m|s)")


class RateLimits(NamedTuple):
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None


class Ticket(NamedTuple):
    tokens: int  # what acquire charged: the request's estimate


def parse_duration(text: str | None) -> float | None:
    """Seconds of a reset header: OpenAI's ``1h2m3.5s``, ``6m0s``, ``20ms``, or plain seconds."""
    if not text:
        return None
    text = text.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    seconds, end = 0.0, 0
    for m in _DURATION_PART.finditer(text):
        if m.start() != end:
            return None
        seconds += float(m.group(1)) * {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}[m.group(2)]
        end = m.end()
    return seconds if end == len(text) and end else None


def usage_tokens(response: Any) -> int | None:
    """Input + output tokens of an OpenAI-style answer (``usage``), None when it says none."""
    try:
        usage = response.json().get("usage")
        if not isinstance(usage, dict):
            return None
        total = usage.get("total_tokens")
        if not isinstance(total, int):
            total = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        return total if total >= 0 else None
    except (ValueError, TypeError, AttributeError):
        return None


def seconds_until(text: str | None, now: float | None = None) -> float | None:
    """Seconds from ``now`` to an RFC 3339 time (Anthropic's reset headers: ``2026-12-03T20:01:30Z``), at least 0."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _header_window(headers: dict, dimension: str) -> tuple[int, float] | None:
    """(remaining, seconds until reset) of one dimension's rate-limit headers, when both are there:
    OpenAI's ``x-ratelimit-remaining-<dim>`` with a duration, or Anthropic's
    ``anthropic-ratelimit-<dim>-remaining`` with an RFC 3339 reset time."""
    remaining, reset = headers.get(f"x-ratelimit-remaining-{dimension}"), headers.get(f"x-ratelimit-reset-{dimension}")
    if remaining is not None and reset is not None:
        seconds = parse_duration(reset)
    else:
        remaining = headers.get(f"anthropic-ratelimit-{dimension}-remaining")
        seconds = seconds_until(headers.get(f"anthropic-ratelimit-{dimension}-reset"))
    if remaining is None:
        return None
    try:
        left = int(float(remaining))
    except ValueError:
        return None
    return (max(0, left), seconds) if seconds else None


class RateLimiter:
    """The pace of one processor's requests (see the module's docstring)."""

    def __init__(self, limits: RateLimits, shared_file: str | os.PathLike | None = None, what: str = "requests"):
        self.limits, self.what = limits, what
        # seconds per request, per token (None: no configured limit on that dimension)
        self._interval = {
            REQUESTS: 60.0 / limits.requests_per_minute if limits.requests_per_minute else None,
            TOKENS: 60.0 / limits.tokens_per_minute if limits.tokens_per_minute else None,
        }
        self.shared_file = Path(shared_file) if shared_file is not None else None
        self._shared = SharedState(self.shared_file, f"{what}: rate limits") if self.shared_file is not None else None
        self._memory: dict = {}
        self._thread_lock = threading.Lock()

    @property
    def counts_tokens(self) -> bool:
        return self._interval[TOKENS] is not None

    # ------------------------------------------------------------------ the shared numbers

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict]:
        if self._shared is None:
            with self._thread_lock:
                yield self._memory
            return
        with self._shared.use() as state:
            yield state

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()

    # ------------------------------------------------------------------ before and after a request

    async def acquire(self, tokens: int = 0) -> Ticket:
        """Wait until a request of ``tokens`` (its estimate) may go, reserving its slot."""
        if self.shared_file is None and not self._memory and not any(self.limits):
            return Ticket(max(0, tokens))  # nothing to keep yet (no limits, no answer said any): no wait, ~free
        now = time.time()
        costs = {REQUESTS: 1, TOKENS: max(0, tokens)}
        with self._state() as state:
            if any(self.limits) and state.get("limits") != list(self.limits):  # new, or the config's limits changed
                state.update(limits=list(self.limits), **{dim: now for dim in (REQUESTS, TOKENS)})
            start = max(now, state.get("pause_until", 0.0))
            for dim in (REQUESTS, TOKENS):
                if self._interval[dim] is not None:
                    start = max(start, state.get(dim, 0.0))
                hint = state.get(f"{dim}_headers")
                if hint and hint[0] > now:  # (until, interval, tat): the provider's "r in s"
                    start = max(start, hint[2])
            for dim in (REQUESTS, TOKENS):
                if self._interval[dim] is not None:
                    state[dim] = start + costs[dim] * self._interval[dim]
                hint = state.get(f"{dim}_headers")
                if hint and hint[0] > start:
                    hint[2] = start + costs[dim] * hint[1]
        wait = start - now
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:  # a shard stopping: its slots go back to the others
                self._give_back(costs)
                raise
        return Ticket(costs[TOKENS])

    def _give_back(self, costs: dict[str, int]) -> None:
        with self._state() as state:
            for dim, interval in self._interval.items():
                if interval is not None and dim in state:
                    state[dim] -= costs[dim] * interval

    def settle(self, ticket: Ticket, response: Any | None) -> None:
        """Learn from the answer to a request ``acquire`` let go (None: no whole answer came)."""
        if response is None:  # the provider may have counted it: the estimate stands
            return
        now, status, headers = time.time(), response.status_code, response.headers
        correction = 0
        if self.counts_tokens:
            if 200 <= status < 300:
                used = usage_tokens(response)
                correction = used - ticket.tokens if used is not None else 0
            elif status == 429:
                correction = -ticket.tokens
        pause = None
        if status in (429, 503):
            pause = parse_duration(headers.get("retry-after"))  # an HTTP date is ignored
        windows = {dim: _header_window(headers, dim) for dim in (REQUESTS, TOKENS)}
        if not correction and not pause and not any(windows.values()):
            return
        with self._state() as state:
            if correction:
                state[TOKENS] = state.get(TOKENS, now) + correction * self._interval[TOKENS]
            if pause:
                state["pause_until"] = max(state.get("pause_until", 0.0), now + pause)
            for dim, window in windows.items():
                if window is None:
                    continue
                left, seconds = window
                hint = state.get(f"{dim}_headers")
                tat = hint[2] if hint and hint[0] > now else now
                if left == 0:  # none left: nothing before the reset
                    state[f"{dim}_headers"] = [now + seconds, 0.0, max(tat, now + seconds)]
                else:
                    state[f"{dim}_headers"] = [now + seconds, seconds / left, tat]

    def details(self) -> dict:
        """What the engine's info shows about its pace."""
        return {
            "max_requests_per_minute": self.limits.requests_per_minute,
            "max_tokens_per_minute": self.limits.tokens_per_minute,
            "shared_file": str(self.shared_file) if self.shared_file else None,
        }


def estimate_tokens(text_chars: int, output_tokens: int) -> int:
    """A request's tokens before it is sent: its prompt's characters / 4 (OpenAI's rule of
    thumb for English), rounded up, plus the output it may generate."""
    return math.ceil(text_chars / 4) + max(0, output_tokens)
