"""Let the driver exit as soon as its run ends, not up to a second later.

Snakemake's scheduler rate-limits job starts (``--max-jobs-per-timespan``, by default
``100/1s``): after each scheduling round it starts a ``threading.Timer`` of one timespan
that wakes the scheduler again (snakemake/scheduling/job_scheduler.py,
``_schedule_reevalutation``). Those timers are not daemon threads, so when the last job
has finished the interpreter waits for the last one before it exits: every run, local or
on SLURM, ends ~1 s after its summary (measured with py-spy on Snakemake 9.27: 1.09 s of
the driver's exit spent in ``threading._shutdown``; scripts/bench/small_run.py).

When the scheduler has returned (onsuccess/onerror), no job is left to wake it for, so the
timers it left are cancelled. Only timers whose callback comes from Snakemake's scheduler
are touched; a Snakemake that no longer uses them leaves nothing to cancel.
"""

from __future__ import annotations

import threading

SCHEDULER_MODULE = "snakemake.scheduling"


def _from_scheduler(thread: threading.Thread) -> bool:
    function = getattr(thread, "function", None)
    return isinstance(thread, threading.Timer) and getattr(function, "__module__", "").startswith(SCHEDULER_MODULE)


def cancel_scheduler_timers() -> int:
    """Cancel the scheduler's pending wake-up timers; returns how many were cancelled."""
    timers = [t for t in threading.enumerate() if _from_scheduler(t) and t.is_alive()]
    for timer in timers:
        timer.cancel()
    return len(timers)
