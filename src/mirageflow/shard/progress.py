"""Live progress of a running shard: ``<state_dir>/shard_<id>/progress.json``, rewritten atomically.

A thread asks the runner for a snapshot (samples and rows finished, samples committed,
output tokens, requests in flight, engine queue depth) every ``interval`` seconds and
writes phase, done / total, rates over the last ``window`` seconds (not since the start,
so a slow model load or a resumed shard does not distort them), the ETA, and who runs the
shard (host, pid, SLURM job). The file also updates while the engine loads, so ``mmirage
status`` can tell a live shard from a dead one.

Units: a sample is one record of a row (``n_samples`` per row; with 1, a sample is a
row). ``samples_*`` count finished samples (as soon as they finish, before their commit;
``samples_committed`` is what is durable), ``rows_*`` source rows whose every sample
finished. Both are bounded by their totals. A rate is measured over the window from
samples that finished in it: when none did (a batch that has not returned yet), there is
no rate and no ETA, and ``eta_note`` says why, instead of "0 rows/s".
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from mirageflow.files import atomic_write_json
from mirageflow.state.records import check_progress, read
from mirageflow.state.remaining import eta_seconds
from mirageflow.stats import formulas as stats

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 5.0
DEFAULT_WINDOW = 180.0  # seconds of history behind the rates
MAX_HISTORY = 240  # (t, rows, tokens) samples kept in progress.json; thinned by half when full


class History:
    """A bounded record of (seconds since the start, rows done, output tokens) over the whole attempt.

    One sample per progress write (every 5 s); when ``limit`` samples are held, every other
    one is dropped (the first and the newest stay) and from then on only every other
    write is kept, and so on: the samples always span the whole attempt, at most ``limit``
    of them.
    """

    def __init__(self, limit: int = MAX_HISTORY):
        self.limit = max(4, limit)
        self.samples: list[list] = []  # kept samples (every stride-th write), then maybe the newest
        self._stride = 1
        self._n = 0
        self._newest_only = False  # the last sample is there only as the newest one

    def add(self, t: float, rows: int | None, tokens: int | None) -> None:
        # Up to the next tenth, never down: a sample taken just after generation began must
        # not read as taken before it (the report's windows start there and would lose its tokens).
        sample = [math.ceil(round(t * 10, 6)) / 10, int(rows or 0), int(tokens or 0)]
        if self._newest_only:
            self.samples.pop()
        self._newest_only = self._n % self._stride != 0
        self.samples.append(sample)
        self._n += 1
        kept = len(self.samples) - self._newest_only
        if kept > self.limit:  # keep the writes at multiples of twice the stride
            newest = self.samples[-1] if self._newest_only else None
            self.samples = self.samples[:kept:2]
            self._stride *= 2
            if (self._n - 1) % self._stride != 0:  # the newest write is no longer a kept one
                last = sample
                if self.samples and self.samples[-1] is not last:
                    self.samples.append(last)
                    self._newest_only = True
                else:
                    self._newest_only = False
            elif newest is not None:
                self.samples.append(newest)

    def to_json(self) -> list[list]:
        return [list(s) for s in self.samples]


def read_progress(path: str | os.PathLike) -> tuple[dict | None, str | None]:
    """(progress, None); (None, None) when there is no file; (None, why) when it is damaged."""
    return read(path, check_progress)


class RateWindow:
    """Rows/s and tokens/s over the last ``window`` seconds of (time, rows, tokens) observations."""

    def __init__(self, window: float = DEFAULT_WINDOW):
        self.window = window
        self.points: deque[tuple[float, int, int]] = deque()

    def add(self, t: float, rows: int, tokens: int) -> None:
        self.points.append((t, rows, tokens))
        # keep one point at or before the window's start, so the span covers the whole window
        while len(self.points) > 2 and self.points[1][0] <= t - self.window:
            self.points.popleft()

    def rates(self) -> tuple[float | None, float | None, float]:
        """(rows/s, tokens/s, seconds covered); None while less than a second is covered."""
        if len(self.points) < 2:
            return None, None, 0.0
        (t0, r0, k0), (t1, r1, k1) = self.points[0], self.points[-1]
        span = t1 - t0
        if span < 1.0:
            return None, None, span
        return (r1 - r0) / span, (k1 - k0) / span, span

    def reset(self) -> None:
        self.points.clear()


class ProgressReporter:
    """Writes progress.json every ``interval`` seconds from a thread, and at each phase change.

    ``rows_total``: the shard's source rows; ``n_samples``: samples per row. ``snapshot()``
    returns a dict with ``samples_done`` (finished, including those resumed from a
    checkpoint; with one sample per row ``rows_done`` alone will do), and optionally
    ``rows_done`` (rows whose every sample finished), ``samples_committed``,
    ``rows_failed``, ``output_tokens``, ``queue_depth``, ``inflight`` and ``engine_restarts``. It runs in the
    reporter's thread.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        shard_id: int,
        rows_total: int | None,
        snapshot: Callable[[], dict],
        *,
        interval: float = DEFAULT_INTERVAL,
        window: float = DEFAULT_WINDOW,
        attempt: int | None = None,
        num_gpus: int | None = None,
        n_samples: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = Path(path)
        self.shard_id = shard_id
        self.rows_total = rows_total
        self.n_samples = n_samples
        self.snapshot = snapshot
        self.interval = interval
        self.attempt = attempt
        self.num_gpus = num_gpus
        self.clock = clock
        self.rates = RateWindow(window)
        self.history = History()
        self.phase = "starting"
        self.started_at = stats.utc_now()
        self.t0 = clock()
        self._phase_since = self.t0
        self._generation_started: float | None = None  # seconds since t0 when generation began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed_writes = 0

    def start(self) -> None:
        self.write()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            if phase == self.phase:
                return
            self.phase = phase
            self._phase_since = self.clock()
            if phase == "generating":
                self.rates.reset()  # rates count generation only
                self._generation_started = self._phase_since - self.t0
        self.write()

    def finish(self, phase: str) -> None:
        """Stop the thread and write the final state (``done`` or ``failed``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
            self._thread = None
        with self._lock:
            self.phase = phase
            self._phase_since = self.clock()
        self.write()

    def state(self) -> dict:
        try:
            snap = self.snapshot()
        except Exception as e:  # counters changing under us: try again next tick
            log.debug("progress snapshot failed: %s", e)
            snap = None
        now = self.clock()
        n = self.n_samples
        with self._lock:
            if snap is not None and self.phase == "generating":
                self.rates.add(now, _samples(snap), snap.get("output_tokens") or 0)
            samples_per_sec, tokens_per_sec, covered = self.rates.rates()
            phase, phase_since, generation_started = self.phase, self._phase_since, self._generation_started
            if snap is not None:
                self.history.add(now - self.t0, _samples(snap), snap.get("output_tokens"))
            history = self.history.to_json()
        snap = snap or {}
        samples_total = None if self.rows_total is None else self.rows_total * n
        samples = _samples(snap) if snap else None
        rows = snap.get("rows_done") if n > 1 else samples
        if samples_total is not None and samples is not None:
            samples, rows = min(samples, samples_total), None if rows is None else min(rows, self.rows_total)
        if samples_per_sec == 0:  # nothing finished in the window: no rate to speak of
            samples_per_sec = tokens_per_sec = None
        eta, note = None, None
        if phase == "done":
            eta = 0.0
        elif phase != "generating":
            note = f"not generating yet ({phase})"
        elif samples_per_sec and samples_total is not None and samples is not None:
            eta = eta_seconds(samples_total - samples, samples_per_sec)
        elif covered < 1.0:
            note = "measuring the rate"
        else:
            inflight = snap.get("inflight")
            note = f"nothing finished in the last {covered:.0f} s" + (f" ({inflight} in flight)" if inflight else "")
        return {
            "shard_id": self.shard_id,
            "phase": phase,
            "phase_seconds": now - phase_since,
            "n_samples": n,
            "rows_done": rows,
            "rows_total": self.rows_total,
            "samples_done": samples,
            "samples_total": samples_total,
            "samples_committed": snap.get("samples_committed"),
            "rows_failed": snap.get("rows_failed"),
            "fraction_done": samples / samples_total if samples_total and samples is not None else (1.0 if samples_total == 0 else None),
            "output_tokens": snap.get("output_tokens"),
            "samples_per_sec": samples_per_sec,
            "rows_per_sec": None if samples_per_sec is None else samples_per_sec / n,
            "tokens_per_sec": tokens_per_sec,
            "rate_window_seconds": covered,
            "eta_seconds": eta,
            "eta_human": stats.human_duration(eta),
            "eta_note": note,
            "queue_depth": snap.get("queue_depth"),
            "inflight": snap.get("inflight"),
            "engine_restarts": snap.get("engine_restarts"),  # the launched servers this attempt restarted
            "elapsed_seconds": now - self.t0,
            "started_at": self.started_at,
            "updated_at": stats.utc_now(),
            "updated_at_unix": time.time(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "attempt": self.attempt,
            "num_gpus": self.num_gpus,
            # [seconds since started_at, samples done, output tokens]: the attempt's throughput over time (report.html)
            "history": history,
            # seconds since started_at when generation began (report.html's rates start there, not at the load)
            "generation_started_seconds": generation_started,
        }

    def write(self) -> None:
        try:
            atomic_write_json(self.path, self.state())
        except OSError as e:  # progress is advisory: a full disk fails the commit, not this
            self._failed_writes += 1
            if self._failed_writes == 1:
                log.warning("cannot write %s: %s", self.path, e)


def _samples(snap: dict) -> int:
    """Samples finished in a snapshot (``rows_done`` where one sample is a row)."""
    value = snap.get("samples_done")
    return int(value if value is not None else snap.get("rows_done") or 0)
