"""The jobs' entry point: the config file on the command line, per-attempt logs, early signals."""

from __future__ import annotations

import calendar
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes.configs import pipeline_config

from mirageflow import jobs
from mirageflow.config import load_config
from mirageflow.state import pipeline as pipeline_state


@pytest.fixture
def pipeline(tmp_path) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(4)))
    return pipeline_config(
        data, model="m", state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=2,
        outputs=[{"name": "a", "prompt": "costs $$5 for ${NAME:-you}: {{ q }}"}],
        dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": "http://127.0.0.1:9/v1"},
        processing={"output_schema": {"z": "{{ a }}", "q": "{{ q }}"}},
    )  # fmt: skip


def job(*args: str, cwd: Path, umask: int | None = None, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MIRAGEFLOW_CONFIG"}
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.Popen(
        [sys.executable, "-m", "mirageflow.jobs", *args], cwd=cwd, env=env, preexec_fn=preexec,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen,
    )  # fmt: skip


def run_job(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    proc = job(*args, cwd=cwd, **kw)
    out, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


# --------------------------------------------------------------------------- the config file


def test_config_file_is_content_addressed_and_written_once(pipeline, tmp_path):
    state = tmp_path / "state"
    path = pipeline_state.write_config(pipeline, state)
    assert path.parent == state / "configs" and len(path.stem) == pipeline_state.CONFIG_HASH_CHARS
    # unexpanded, keys in the given order: the job expands $VAR in its own environment
    assert path.read_text() == json.dumps(pipeline, indent=1) + "\n"
    assert list(json.loads(path.read_text())["processing_params"]["output_schema"]) == ["z", "q"]
    before = path.stat().st_mtime_ns
    time.sleep(0.01)
    assert pipeline_state.write_config(pipeline, state) == path and path.stat().st_mtime_ns == before
    other = pipeline_state.write_config({**pipeline, "stats": True}, state)
    assert other != path and other.exists() and path.exists()
    assert not list((state / "configs").glob(".*.tmp"))


def test_a_config_far_beyond_the_old_environment_limit_is_fine(pipeline, tmp_path):
    pipeline["processing_params"]["outputs"][0]["system"] = "Be precise. " * 40_000  # ~480 KB
    path = pipeline_state.write_config(pipeline, tmp_path / "state")
    proc = run_job("--config", str(path), "--log", "logs/index.log", "index", "0", "state/ds.index.json", cwd=tmp_path)
    assert proc.returncode == 0, (tmp_path / "logs" / "index.log").read_text()


def test_printed_command_runs_by_hand(pipeline, tmp_path):
    """What Snakemake prints (`python -m mirageflow.jobs --config <file> --log <log> ...`) needs nothing else."""
    path = pipeline_state.write_config(pipeline, tmp_path / "state")
    proc = run_job(
        "--config", str(path), "--log", "state/logs/index_dataset_0.log", "index", "0", "state/datasets/dataset_0.index.json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout
    assert json.loads((tmp_path / "state/datasets/dataset_0.index.json").read_text())["rows"] == 4
    assert "indexed" in (tmp_path / "state/logs/index_dataset_0.log").read_text()


def test_job_expands_env_vars_in_its_own_environment(pipeline, tmp_path, monkeypatch):
    pipeline["loading_params"]["state_dir"] = "${STATE_ROOT}/state"
    path = pipeline_state.write_config(pipeline, tmp_path / "state")
    monkeypatch.setenv("STATE_ROOT", str(tmp_path / "elsewhere"))
    assert jobs._config(str(path)).state_dir == str(tmp_path / "elsewhere" / "state")


def test_job_without_a_config_is_a_usage_error(tmp_path):
    proc = run_job("--log", "shard_0.log", "shard", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--config" in proc.stdout


# --------------------------------------------------------------------------- logs


def test_every_attempt_keeps_its_log(pipeline, tmp_path):
    """Snakemake deletes the rule's log before a rerun; each attempt's log stays under logs/attempts/."""
    path = pipeline_state.write_config(pipeline, tmp_path / "state")
    log = tmp_path / "state" / "logs" / "shard_0.log"
    for _ in range(2):  # the index is missing: the shard fails at once
        proc = run_job("--config", str(path), "--log", str(log), "shard", "0", cwd=tmp_path)
        assert proc.returncode != 0
        log.unlink()  # as Snakemake does before the next attempt
    proc = run_job("--config", str(path), "--log", str(log), "shard", "0", "--attempt", "3", cwd=tmp_path)
    attempts = sorted((tmp_path / "state" / "logs" / "attempts").glob("shard_0.*.log"))
    assert len(attempts) == 3, attempts
    for a in attempts:
        assert "Traceback" in a.read_text()
    newest = max(attempts, key=lambda p: p.stat().st_mtime_ns)
    assert os.path.samestat(log.stat(), newest.stat())  # the rule's log is the latest attempt's


def test_attempt_log_path():
    when = calendar.timegm((2026, 3, 4, 5, 6, 7, 0, 0, 0))
    assert jobs.attempt_log_path("st/logs/shard_12.log", when, 42) == "st/logs/attempts/shard_12.20260304T050607Z.42.log"


@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o077, 0o600), (0o022, 0o644)])
def test_log_files_follow_the_umask(tmp_path, umask, mode):
    log = tmp_path / "logs" / "aggregate.log"
    run_job("--config", str(tmp_path / "absent.yaml"), "--log", str(log), "aggregate", cwd=tmp_path, umask=umask)
    (attempt,) = (tmp_path / "logs" / "attempts").iterdir()
    assert stat.S_IMODE(log.stat().st_mode) == mode
    assert stat.S_IMODE(attempt.stat().st_mode) == mode


# --------------------------------------------------------------------------- signals while starting


def _catches(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (signum - 1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_startup_writes_failure_json(pipeline, tmp_path, signum):
    """Stopped during the imports (before the shard runner handles signals): a failure record all the same."""
    path = pipeline_state.write_config(pipeline, tmp_path / "state")
    proc = job("--config", str(path), "--log", "state/logs/shard_1.log", "shard", "1", "--attempt", "2", cwd=tmp_path)
    deadline = time.monotonic() + 10
    # the handler is installed before the heavy imports; Python's own SIGINT handler comes first
    while not (_catches(proc.pid, signal.SIGTERM) and _catches(proc.pid, signal.SIGINT)) and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signum)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum
    failure = json.loads((tmp_path / "state" / "shard_1" / "failure.json").read_text())
    assert failure["signal"] == signal.Signals(signum).name and failure["status"] == "failed"
    assert (failure["shard_id"], failure["attempt"], failure["pid"]) == (1, 2, proc.pid)
    assert "before the shard started" in failure["error"] and failure["finished_at"].endswith("+00:00")
    from mirageflow.state.records import check_failure

    assert check_failure(failure) is None  # the report reads it like the runner's own


def test_early_argv():
    found = jobs._early_argv(["--config", "s/configs/a.json", "--log=l.log", "shard", "7", "--attempt", "3"])
    assert (found["config"], found["log"], found["job"], found["shard"], found["attempt"]) == ("s/configs/a.json", "l.log", "shard", 7, "3")


# --------------------------------------------------------------------------- derived outputs


def test_shard_start_marks_what_was_built_from_earlier_shards_as_the_previous_runs(pipeline, tmp_path, monkeypatch):
    import mirageflow.shard.runner

    path = pipeline_state.write_config(pipeline, tmp_path / "state")
    state, out = tmp_path / "state", tmp_path / "out"
    derived = [state / "metrics.json", state / "summary.md", state / "report.html", state / "merged" / "dataset_0.json"]
    for p in derived:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{}")
    (out / "merged").mkdir(parents=True)
    (out / "merged" / "part-00000.jsonl").write_text("{}\n")
    (out / "README.md").write_text("# the dataset card\n")  # the card rule's, beside merged/
    derived.append(out / "README.md")
    (out / "shard_0").mkdir()
    seen = {}
    monkeypatch.setattr(mirageflow.shard.runner, "run_shard", lambda cfg, shard, attempt: seen.update(shard=shard, attempt=attempt))
    for name in ("HF_HUB_OFFLINE", "HF_HOME"):  # a job's environment (hub_models.offline_environment): undone after the test
        monkeypatch.delenv(name, raising=False)
    jobs.run_shard(str(path), 0, 4)
    assert seen == {"shard": 0, "attempt": 4}
    # readable until this run's replace them, and marked as the previous run's
    assert all(p.exists() for p in derived) and (out / "merged" / "part-00000.jsonl").exists()
    marked = json.loads((state / "previous_results.json").read_text())
    assert marked["why"] == "shard 0 started again"
    assert set(marked["outputs"]) >= {str(p) for p in derived} | {str(out / "merged")}
    assert json.loads((state / "metrics.json").read_text()) == {"previous_run": {"why": marked["why"], "since": marked["since"]}}
    assert "The results of a previous run" in (state / "report.html").read_text()
    assert pipeline_state.previous_results(load_config(str(path)))["outputs"]  # still the previous run's
    assert (out / "shard_0").exists()  # the shards' own outputs stay
