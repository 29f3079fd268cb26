"""SIGTERM before the time limit for shard jobs that sbatch ``--signal`` cannot reach.

Shard jobs are submitted with ``--signal=TERM@<s>`` (mirageflow.cluster.resources): SLURM signals
the job's *steps* ``s`` seconds before the limit, and the shard, run by the SLURM plugin's
``srun``, commits and writes failure.json. But snakemake-executor-plugin-slurm 2.8 runs the
first task of every job array without ``srun``, in the batch step, which ``--signal`` does
not reach (``B:`` would signal only the batch shell, which does not pass it on): measured
on the test SLURM, that shard ran until SLURM killed it at the limit.

So a shard job inside SLURM but outside a job step (``SLURM_JOB_ID`` set,
``SLURM_STEP_ID`` not: the plugin passes no step variables to its batch-step command) reads
its end time and time limit from ``scontrol show job`` and sends itself SIGTERM at the
same lead time (``cluster.term_signal_seconds``) from a timer thread. Inside a step it does
nothing: SLURM's own signal comes, and a second SIGTERM during the final commit would
interrupt it. Outside SLURM it does nothing.

Called by the shard job's entry point (mirageflow.jobs.run_shard) before the runner
starts: ``arm_time_limit_signal()``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime
from typing import Callable, Mapping

from mirageflow.cluster.resources import minutes, term_signal_seconds

log = logging.getLogger(__name__)


def _scontrol_show_job(jobid: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "--oneliner", jobid], capture_output=True, text=True, timeout=30, check=True).stdout


def job_end_and_limit(text: str) -> tuple[float, int] | None:
    """(end time as a Unix time, time limit in minutes) from ``scontrol show job``, or None."""
    end = re.search(r"\bEndTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\b", text)
    limit = re.search(r"\bTimeLimit=(\S+)", text)
    if not end or not limit:
        return None
    value = limit.group(1)
    if value.count(":") == 1:  # MM:SS
        value = "00:" + value
    try:
        return datetime.fromisoformat(end.group(1)).timestamp(), minutes(value)  # scontrol prints local time
    except ValueError:  # UNLIMITED, Partition_Limit, ...
        return None


def arm_time_limit_signal(
    environ: Mapping[str, str] | None = None,
    *,
    show_job: Callable[[str], str] = _scontrol_show_job,
    now: Callable[[], float] = time.time,
    kill: Callable[[int, int], None] = os.kill,
) -> threading.Timer | None:
    """In a SLURM job outside any job step, SIGTERM this process before the time limit.

    Returns the started (daemon) timer, or None when SLURM's ``--signal`` covers the job,
    outside SLURM, or when the end time cannot be read (nothing fails because of it).
    """
    environ = os.environ if environ is None else environ
    jobid = environ.get("SLURM_JOB_ID")
    if not jobid or environ.get("SLURM_STEP_ID") is not None:
        return None
    try:
        found = job_end_and_limit(show_job(jobid))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("time limit: cannot read job %s (%s); no SIGTERM before the limit", jobid, e)
        return None
    if found is None:
        return None
    end, limit = found
    lead = term_signal_seconds(limit)
    delay = max(0.0, end - lead - now())
    pid = os.getpid()
    timer = threading.Timer(delay, kill, (pid, signal.SIGTERM))
    timer.daemon = True
    timer.start()
    log.info("time limit: SIGTERM to this job in %.0f s, %d s before its end (no job step for SLURM's --signal)", delay, lead)
    return timer
