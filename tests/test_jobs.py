"""The jobs' entry point: config handed over in the environment, clear errors without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mirageflow import jobs


def test_export_config_round_trips_the_raw_config(monkeypatch):
    monkeypatch.delenv(jobs.CONFIG_ENV, raising=False)
    raw = {"processing_params": {"outputs": [{"prompt": "costs $$5 for ${NAME:-you}"}]}}
    jobs.export_config(raw)
    # unexpanded: the job expands $VAR in its own environment, as the driver did
    assert json.loads(os.environ[jobs.CONFIG_ENV]) == raw


def test_export_config_refuses_what_the_environment_cannot_hold(monkeypatch):
    monkeypatch.delenv(jobs.CONFIG_ENV, raising=False)
    with pytest.raises(ValueError, match=r"\$MIRAGEFLOW_CONFIG, which holds at most"):
        jobs.export_config({"prompt": "x" * jobs.MAX_CONFIG_BYTES})
    assert jobs.CONFIG_ENV not in os.environ


def test_job_without_the_config_says_how_to_run_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != jobs.CONFIG_ENV}
    log = tmp_path / "logs" / "shard_0.log"
    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.jobs", "--log", str(log), "shard", "0"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "$MIRAGEFLOW_CONFIG is not set: run this job through the workflow" in log.read_text()
