"""Benchmark figures: phase timers, GPU allocation, and the seed page's formulas.

Output tokens are completion tokens. Per-GPU rates use the GPUs the job *holds*, not the
engine's tp_size, and a null (not 0 or infinity) where no GPU was held or nothing ran.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone

SECONDS_PER_DAY = 86400.0


def utc_now() -> str:
    """UTC ISO 8601 timestamp with offset (comparable across hosts and time zones)."""
    return datetime.now(timezone.utc).isoformat()


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def human_duration(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{h:02d}:{m:02d}:{s:02d}"


def allocated_gpus(environ=os.environ) -> int:
    """GPUs this job holds: CUDA_VISIBLE_DEVICES when set (the scheduler's allocation), else all NVML sees."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break  # CUDA hides every device from the first invalid entry on
            count += 1
        return count
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: no GPU
        return 0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def tokens_per_sec_per_gpu(output_tokens: int, seconds: float, num_gpus: int) -> float | None:
    """output_tokens / (seconds * num_gpus)."""
    return _ratio(output_tokens, seconds * num_gpus)


def gpu_days_per_billion_tokens(output_tokens: int, seconds: float, num_gpus: int) -> float | None:
    """(num_gpus * seconds / 86400) / (output_tokens / 1e9) = 11574.07 / tokens_per_sec_per_gpu."""
    if num_gpus <= 0 or output_tokens <= 0:
        return None
    return (num_gpus * seconds / SECONDS_PER_DAY) / (output_tokens / 1e9)


def rate_figures(output_tokens: int, seconds: float, num_gpus: int) -> dict:
    return {
        "tokens_per_sec": _ratio(output_tokens, seconds),
        "tokens_per_sec_per_gpu": tokens_per_sec_per_gpu(output_tokens, seconds, num_gpus),
        "gpu_days_per_billion_tokens": gpu_days_per_billion_tokens(output_tokens, seconds, num_gpus),
    }


class PhaseTimer:
    """Accumulates monotonic seconds per named phase (load, prepare, generate, write)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start


class InflightTracker:
    """Engine occupancy seen from the runner: generation window, busy time, idle gaps.

    The generation window runs from the first request to the last completion; an idle gap
    is a stretch inside it with no request in flight (the engine waited for Python).
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.inflight = 0
        self.peak = 0
        self.first: float | None = None
        self.last: float | None = None
        self.busy_seconds = 0.0
        self.idle_gaps = 0
        self._busy_since = 0.0

    def submitted(self) -> None:
        now = self.clock()
        if self.inflight == 0:
            if self.first is None:
                self.first = now
            else:
                self.idle_gaps += 1
            self._busy_since = now
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)

    def completed(self) -> None:
        now = self.clock()
        self.inflight -= 1
        if self.inflight == 0:
            self.busy_seconds += now - self._busy_since
        self.last = now

    @property
    def window_seconds(self) -> float:
        if self.first is None or self.last is None:
            return 0.0
        return self.last - self.first

    def summary(self) -> dict:
        busy = self.busy_seconds + (self.clock() - self._busy_since if self.inflight else 0.0)
        return {
            "engine_busy_seconds": busy,
            "engine_idle_seconds": max(0.0, self.window_seconds - busy),
            "engine_idle_gaps": self.idle_gaps,
            "peak_inflight": self.peak,
        }
