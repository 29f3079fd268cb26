"""An inference server's own figures, from its Prometheus ``/metrics`` (not an engine).

vLLM always serves ``/metrics``; SGLang with ``--enable-metrics``. ``ServerMetrics`` scrapes
it when the engine has started (``begin``) and before it stops (``end``): the counters'
differences are what this engine's requests cost the server (prompt and generated tokens,
requests, prefix-cache queries and hits, preemptions). A daemon thread samples the gauges
(requests waiting in the server's queue, requests running) every ``interval`` seconds in
between. ``summary()`` is what status.json shows per engine (``server_metrics``), beside our
own counters; ``reconcile`` states both token totals and why they differ.

Names, checked against the packages (tests/test_real_vllm.py, tests/real_sglang_checks.py):

- vLLM 0.32 (vllm/v1/metrics/loggers.py): ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total``,
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens),
  ``vllm:num_preemptions_total``, ``vllm:num_requests_waiting``, ``vllm:num_requests_running``.
  vLLM counts a request's prompt once per choice (``n``).
- SGLang 0.5.23 (srt/observability/metrics_collector.py): ``sglang:prompt_tokens_total``,
  ``sglang:generation_tokens_total``, ``sglang:num_requests_total``,
  ``sglang:cached_tokens_total`` (prompt tokens served from its radix cache),
  ``sglang:num_retracted_requests_total`` (its preemptions), ``sglang:num_queue_reqs``,
  ``sglang:num_running_reqs``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from mirageflow.engines.base import EngineError
from mirageflow.engines.http import parse_prometheus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricNames:
    prompt_tokens: str
    generation_tokens: str
    requests: str
    cache_queries: str  # prompt tokens looked up in the prefix cache
    cache_hits: str  # of which found there
    preemptions: str
    waiting: str  # gauge: requests in the server's queue
    running: str  # gauge: requests being computed

    @property
    def counters(self) -> list[str]:
        return list(
            dict.fromkeys(
                [self.prompt_tokens, self.generation_tokens, self.requests, self.cache_queries, self.cache_hits, self.preemptions]
            )
        )

    @property
    def gauges(self) -> list[str]:
        return [self.waiting, self.running]

    @property
    def all(self) -> list[str]:
        return [*self.counters, *self.gauges]


VLLM = MetricNames(
    prompt_tokens="vllm:prompt_tokens_total", generation_tokens="vllm:generation_tokens_total",
    requests="vllm:request_success_total", cache_queries="vllm:prefix_cache_queries_total",
    cache_hits="vllm:prefix_cache_hits_total", preemptions="vllm:num_preemptions_total",
    waiting="vllm:num_requests_waiting", running="vllm:num_requests_running",
)  # fmt: skip
SGLANG = MetricNames(
    prompt_tokens="sglang:prompt_tokens_total", generation_tokens="sglang:generation_tokens_total",
    requests="sglang:num_requests_total", cache_queries="sglang:prompt_tokens_total",
    cache_hits="sglang:cached_tokens_total", preemptions="sglang:num_retracted_requests_total",
    waiting="sglang:num_queue_reqs", running="sglang:num_running_reqs",
)  # fmt: skip
SERVERS = {"vllm": VLLM, "sglang": SGLANG}

SAMPLE_INTERVAL = 2.0  # seconds between gauge samples (a /metrics render costs the server a few ms)


class ServerMetrics:
    def __init__(self, url: str, server: str, interval: float = SAMPLE_INTERVAL):
        self.url, self.server, self.names = url, server, SERVERS[server]
        self.interval = interval
        self.first: dict | None = None
        self.last: dict | None = None
        self.errors: list[str] = []
        self._waiting: list[float] = []
        self._running: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape(self) -> dict | None:
        """The named metrics now (None, and the error kept, when the server does not answer)."""
        from mirageflow.transport.http_client import get_blocking

        try:
            r = get_blocking(self.url, 10.0)
            if r.status_code != 200:
                raise EngineError(f"HTTP {r.status_code} from {self.url}")
        except Exception as e:  # noqa: BLE001 - the server's figures are informational
            if len(self.errors) < 5:
                self.errors.append(f"{type(e).__name__}: {e}")
            return None
        return parse_prometheus(r.text, self.names.all)

    def begin(self) -> None:
        self.first = self.scrape()
        self._thread = threading.Thread(target=self._sample, name=f"{self.server}-metrics", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._keep(self.scrape())

    def _keep(self, found: dict | None) -> None:
        if found is None:
            return
        if found.get(self.names.waiting) is not None:
            self._waiting.append(found[self.names.waiting])
        if found.get(self.names.running) is not None:
            self._running.append(found[self.names.running])

    def end(self, alive: bool = True) -> None:
        """Stop sampling; scrape the counters a last time when the server is ``alive``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        if alive and self.last is None:
            self.last = self.scrape()
            self._keep(self.last)

    def summary(self) -> dict:
        """The server's figures for this engine's run: counter differences and gauge samples."""
        n = self.names
        first, last = self.first or {}, self.last or {}

        def delta(name: str) -> float | None:
            if first.get(name) is None or last.get(name) is None:
                return None
            return last[name] - first[name]

        queries, hits = delta(n.cache_queries), delta(n.cache_hits)
        return {
            "server": self.server,
            "url": self.url,
            "complete": self.first is not None and self.last is not None,  # both scrapes answered
            "prompt_tokens": _int(delta(n.prompt_tokens)),
            "generation_tokens": _int(delta(n.generation_tokens)),
            "requests": _int(delta(n.requests)),
            "prefix_cache_queries": _int(queries),
            "prefix_cache_hits": _int(hits),
            "prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
            "preemptions": _int(delta(n.preemptions)),
            "queue_length_max": max(self._waiting) if self._waiting else None,
            "queue_length_mean": sum(self._waiting) / len(self._waiting) if self._waiting else None,
            "running_max": max(self._running) if self._running else None,
            "samples": len(self._waiting),
            "errors": list(self.errors),
        }


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def reconcile(ours_input: int, ours_output: int, ours_input_per_choice: int, server: dict) -> dict:
    """Our token totals beside the server's, and why they differ when they do.

    ``ours_input_per_choice``: our prompt tokens counted once per choice, as vLLM counts a
    request with ``n`` (equal to ``ours_input`` without native n)."""
    theirs_in, theirs_out = server.get("prompt_tokens"), server.get("generation_tokens")
    out = {
        "input_tokens": ours_input, "server_prompt_tokens": theirs_in,
        "output_tokens": ours_output, "server_generation_tokens": theirs_out,
    }  # fmt: skip
    if theirs_in is None or theirs_out is None:
        return {**out, "reconciled": None, "note": "the server's counters could not be read at start and end"}
    notes = []
    if theirs_in != ours_input:
        if theirs_in == ours_input_per_choice:
            notes.append(
                f"the server counts a request's prompt once per choice (native n): {theirs_in} = our "
                f"{ours_input} prompt tokens counted once per request, {ours_input_per_choice} once per choice"
            )
        else:
            notes.append(f"prompt tokens differ: ours {ours_input}, the server's {theirs_in}")
    if theirs_out != ours_output:
        notes.append(f"generated tokens differ: ours {ours_output}, the server's {theirs_out}")
    explained = all(note.startswith("the server counts") for note in notes)
    if notes and not explained:
        notes.append("(requests the server ran that we did not book: retried or abandoned ones, other clients)")
    return {**out, "reconciled": not notes or explained, "note": "; ".join(notes) or None}
