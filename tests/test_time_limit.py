"""SIGTERM before the time limit for shard jobs outside a SLURM job step (mirageflow.cluster.time_limit)."""

from __future__ import annotations

import signal
import time
from datetime import datetime

import pytest

from mirageflow.cluster.time_limit import arm_time_limit_signal, job_end_and_limit

END = "2026-12-01T10:00:00"
SHOW = f"JobId=98 ArrayJobId=91 ArrayTaskId=1 JobState=RUNNING TimeLimit=00:10:00 StartTime=2026-12-01T09:50:00 EndTime={END} Partition=gpu"


def test_reads_end_time_and_limit():
    end, limit = job_end_and_limit(SHOW)
    assert end == datetime.fromisoformat(END).timestamp() and limit == 10
    assert job_end_and_limit(SHOW.replace("TimeLimit=00:10:00", "TimeLimit=05:00"))[1] == 5
    assert job_end_and_limit(SHOW.replace("TimeLimit=00:10:00", "TimeLimit=UNLIMITED")) is None
    assert job_end_and_limit("JobId=1 JobState=PENDING") is None


def test_batch_step_job_signals_itself_a_tenth_before_the_end():
    sent = []
    end = datetime.fromisoformat(END).timestamp()
    timer = arm_time_limit_signal(
        {"SLURM_JOB_ID": "98"}, show_job=lambda j: SHOW, now=lambda: end - 60.05, kill=lambda p, s: sent.append(s)
    )
    assert timer is not None and timer.daemon
    assert timer.interval == pytest.approx(0.05)  # 10-minute limit: 60 s before the end
    timer.join(5)
    assert sent == [signal.SIGTERM]


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": "98", "SLURM_STEP_ID": "0"}])
def test_nothing_outside_slurm_or_inside_a_step(env):
    """In a step SLURM's own --signal comes; a second SIGTERM would interrupt the commit."""
    assert arm_time_limit_signal(env, show_job=lambda j: pytest.fail("no scontrol")) is None


def test_unreadable_job_is_not_an_error():
    def broken(jobid):
        raise OSError("scontrol: not found")

    assert arm_time_limit_signal({"SLURM_JOB_ID": "5"}, show_job=broken) is None


def test_past_the_lead_time_signals_at_once():
    sent = []
    end = datetime.fromisoformat(END).timestamp()
    timer = arm_time_limit_signal({"SLURM_JOB_ID": "98"}, show_job=lambda j: SHOW, now=lambda: end - 1, kill=lambda p, s: sent.append(s))
    timer.join(5)
    assert timer.interval == 0 and sent == [signal.SIGTERM]
    time.sleep(0)
