"""Damaged state files (status.json, failure.json, progress.json, lease.json, gpu_samples.json).

A file that does not parse or has the wrong shape is named in a one-line warning (and in the
report), never a crash of `mmirage status`, `mmirage stats` or the aggregate rule. A damaged
status.json never counts as done: the shard is failed with the reason, and write_report (the
aggregate rule) raises after writing the report, so the workflow does not claim success.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mirageflow import cli
from mirageflow.report import aggregate as report
from mirageflow.state.shards import shard_states
from mirageflow.files import atomic_write_json

from fakes.runs import make_state, report_images

NOT_JSON = {
    "array": b"[]",
    "empty_object": b"{}",
    "random_bytes": random.Random(7).randbytes(200),
    "empty": b"",
    "truncated": b'{"status": "success", "stats": {"runtime_sec',
    "number": b"42",
}
# parse, but the wrong shape for each file
WRONG_SHAPE = {
    "status.json": {
        "status": "success",
        "stats": [],
        "started_at": "2025-03-01T10:00:00+00:00",
        "finished_at": "2025-03-01T10:10:00+00:00",
    },
    "failure.json": {"error": 5, "stats": {"rows_failed": "many"}},
    "progress.json": {"phase": "generating", "updated_at_unix": "a minute ago", "fraction_done": [0.5]},
    "lease.json": {"hostname": ["n1"], "heartbeat": "now"},
}

LEASE = 300.0  # shard_params.lease_timeout_seconds' default


def _damage(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())


def _contents(name: str) -> list:
    return [pytest.param(v, id=k) for k, v in NOT_JSON.items()] + [pytest.param(WRONG_SHAPE[name], id="wrong_shape")]


def _workdir(root: Path, num_shards: int) -> Path:
    """A pipeline.yaml whose state_dir is root/state (the model path is never looked at by status/stats)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "in.jsonl").write_text('{"q": "a"}\n')
    (root / "pipeline.yaml").write_text(yaml.safe_dump({
        "processors": [{"type": "llm", "backend": "transformers", "server_args": {"model_path": "no/such/model"}}],
        "loading_params": {"state_dir": "state", "num_shards": num_shards,
                           "datasets": [{"path": "in.jsonl", "type": "JSONL", "output_dir": "out"}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}],
                              "output_schema": {"a": "{{ a }}"}},
    }))  # fmt: skip
    return root


def _finished(root: Path, num_shards: int = 3) -> Path:
    """make_state's run: shards 0..n-2 done (with progress.json 'done'), the last failed."""
    make_state(root, num_shards=num_shards)
    for shard in range(num_shards - 1):
        atomic_write_json(root / "state" / f"shard_{shard}" / "progress.json", {
            "shard_id": shard, "phase": "done", "rows_done": 500, "rows_total": 500, "fraction_done": 1.0,
            "updated_at_unix": time.time() - 3600, "hostname": f"gpu{shard:03d}",
        })  # fmt: skip
    return _workdir(root, num_shards)


def mmirage(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mirageflow.cli", *args], cwd=cwd, capture_output=True, text=True)


def _warnings(stderr: str, path: str) -> list[str]:
    return [line for line in stderr.splitlines() if f"damaged state file {path}:" in line]


# --------------------------------------------------------------------------- files that are only advisory


@pytest.mark.parametrize("content", _contents("progress.json"))
def test_damaged_progress_json_of_a_finished_shard(tmp_path, content):
    root = _finished(tmp_path)
    path = root / "state/shard_0/progress.json"
    _damage(path, content)
    states = shard_states(root / "state", 3, LEASE)
    assert states[0].state == "done" and states[0].progress is None
    assert [x["file"] for x in states[0].damaged] == ["progress.json"]

    metrics = report.write_report(root / "state", 3)  # the aggregate rule: no crash, no failure
    assert metrics["aggregate"]["completed_shards"] == 2
    assert [(x["shard_id"], x["file"]) for x in metrics["aggregate"]["damaged_state_files"]] == [(0, "progress.json")]
    for name in ("summary.md", "report.html"):
        assert f"damaged state file {path}" in (root / "state" / name).read_text(), name

    proc = mmirage(root, "status", "--config", "pipeline.yaml", "--all")
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr  # the last shard failed; nothing crashed
    assert "done 2, running 0, failed 1, pending 0" in proc.stdout
    assert len(_warnings(proc.stderr, "state/shard_0/progress.json")) == 1, proc.stderr
    assert "Traceback" not in proc.stderr

    proc = mmirage(root, "stats", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    assert json.loads(proc.stdout)["aggregate"]["completed_shards"] == 2
    assert len(_warnings(proc.stderr, "state/shard_0/progress.json")) == 1, proc.stderr


@pytest.mark.parametrize("content", _contents("lease.json"))
def test_damaged_lease_json_is_ignored_with_a_warning(tmp_path, content):
    root = _finished(tmp_path)
    _damage(root / "state/shard_1/lease.json", content)
    states = shard_states(root / "state", 3, LEASE)
    assert [s.state for s in states] == ["done", "done", "failed"]
    assert [x["file"] for x in states[1].damaged] == ["lease.json"]
    report.write_report(root / "state", 3)
    proc = mmirage(root, "status", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED and len(_warnings(proc.stderr, "state/shard_1/lease.json")) == 1, proc.stderr


def test_damaged_progress_json_alone_says_running_while_fresh_then_failed(tmp_path):
    state = tmp_path / "state"
    path = state / "shard_0" / "progress.json"
    _damage(path, b"[]")
    entry = shard_states(state, 1, LEASE)[0]
    assert entry.state == "running"  # written a moment ago: the shard is alive
    old = time.time() - 3600
    os.utime(path, (old, old))
    entry = shard_states(state, 1, LEASE)[0]
    assert entry.state == "failed" and entry.error.startswith(f"damaged state file {path}: ")
    assert "killed?" in entry.error


@pytest.mark.parametrize(
    "content",
    [b"[]", NOT_JSON["random_bytes"], {"t": [0.0, 1.0], "util": [[50.0]]}, {"t": "0 1 2"}],
    ids=["array", "bytes", "short_series", "wrong_t"],
)
def test_damaged_gpu_samples_json_gets_a_note_and_the_other_shards_are_plotted(tmp_path, content, caplog):
    root = _finished(tmp_path, num_shards=4)
    path = root / "state/shard_1/gpu_samples.json"
    _damage(path, content)
    report.write_report(root / "state", 4)
    page = (root / "state/report.html").read_text()
    assert f"damaged state file {path}" in page
    assert len(report_images(page)) == 4  # shards, GPU utilisation (shards 0 and 2), tokens per row, errors
    warned = [r.getMessage() for r in caplog.records if "gpu_samples.json" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"damaged state file {path}: ") and "\n" not in warned[0]


# --------------------------------------------------------------------------- failure.json


@pytest.mark.parametrize("content", _contents("failure.json"))
def test_damaged_failure_json_is_a_failed_shard(tmp_path, content):
    root = _finished(tmp_path)
    path = root / "state/shard_2/failure.json"
    _damage(path, content)
    entry = shard_states(root / "state", 3, LEASE)[2]
    assert entry.state == "failed" and entry.error.startswith(f"damaged state file {path}: ")
    metrics = report.write_report(root / "state", 3)
    assert [f["shard_id"] for f in metrics["aggregate"]["failed_shards"]] == [2]
    proc = mmirage(root, "status", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr
    assert "done 2, running 0, failed 1, pending 0" in proc.stdout
    assert "damaged state file state/shard_2/failure.json" in proc.stdout  # the shard's line says why
    assert len(_warnings(proc.stderr, "state/shard_2/failure.json")) == 1 and "Traceback" not in proc.stderr


def test_a_failure_json_without_stats_or_error_text_is_shown(tmp_path, capsys, monkeypatch):
    """The early-stop record (stats null) and an empty error both print."""
    root = _workdir(tmp_path / "w", 2)
    atomic_write_json(root / "state/shard_0/failure.json", {"shard_id": 0, "attempt": "2", "error": "", "signal": "SIGTERM", "stats": None})
    atomic_write_json(
        root / "state/shard_1/failure.json", {"shard_id": 1, "error": "stopped by SIGINT before the shard started", "stats": None}
    )
    monkeypatch.chdir(root)
    assert cli.main(["status", "--config", "pipeline.yaml"]) == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert "no error recorded [SIGTERM]" in out and "stopped by SIGINT" in out
    agg = report.compute_metrics(root / "state", 2)["aggregate"]
    assert agg["total_rows_failed"] == 0 and agg["damaged_state_files"] == []


def test_the_engine_death_class_that_failed_a_shard_is_a_field_of_its_state(tmp_path):
    """failure.json's failure_class is read once, by the state machine, as error and signal
    are: `mmirage status --json`, `mmirage retry --failure-class` and the report take it there."""
    root = _workdir(tmp_path / "w", 3)
    atomic_write_json(root / "state/shard_0/failure.json", {"shard_id": 0, "error": "ServerDied: ...", "failure_class": "frozen"})
    atomic_write_json(root / "state/shard_1/failure.json", {"shard_id": 1, "error": "ShardFailed: rows", "signal": None})
    states = shard_states(root / "state", 3, LEASE)
    assert [(s.state, s.failure_class) for s in states[:2]] == [("failed", "frozen"), ("failed", None)]
    assert states[0].to_json()["failure_class"] == "frozen" and "failure_class" not in states[2].to_json()


# --------------------------------------------------------------------------- status.json: never done when damaged


@pytest.mark.parametrize("content", _contents("status.json"))
def test_damaged_status_json_is_not_done_and_fails_the_aggregate(tmp_path, content, monkeypatch):
    root = _finished(tmp_path)
    path = root / "state/shard_1/status.json"
    _damage(path, content)
    entry = shard_states(root / "state", 3, LEASE)[1]
    assert entry.state == "failed" and entry.error.startswith(f"damaged state file {path}: ")
    assert "not counted as done" in entry.error

    metrics = report.compute_metrics(root / "state", 3)  # mmirage stats: reads and reports
    agg = metrics["aggregate"]
    assert agg["completed_shards"] == 1 and agg["missing_shards"] == [1, 2]
    assert [f["shard_id"] for f in agg["failed_shards"]] == [1, 2]
    assert [s["shard_id"] for s in metrics["per_shard"]] == [0]

    with pytest.raises(report.DamagedStateError, match=r"shard_1/status.json"):
        report.write_report(root / "state", 3)  # the aggregate rule fails: the run is not complete
    page = (root / "state/report.html").read_text()  # ... after writing the report that says why
    assert f"damaged state file {path}" in page and "1 / 3" in page

    proc = mmirage(root, "status", "--config", "pipeline.yaml", "--all")
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr
    assert "done 1, running 0, failed 2, pending 0" in proc.stdout
    assert "damaged state file state/shard_1/status.json" in proc.stdout
    assert len(_warnings(proc.stderr, "state/shard_1/status.json")) == 1 and "Traceback" not in proc.stderr

    proc = mmirage(root, "stats", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_OK and json.loads(proc.stdout)["aggregate"]["completed_shards"] == 1, proc.stderr

    monkeypatch.chdir(root)  # `mmirage retry` forces the damaged shard's rerun: Snakemake sees its status.json
    plan = cli.retry_plan(cli._load("pipeline.yaml", check_paths=False), failed_rows=False)
    assert plan["damaged_status"] == [1] and plan["unfinished"] == [1, 2]


def _figures(value, path=""):
    """(path, number) of every number in a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _figures(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _figures(v, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -12000], ids=["NaN", "Infinity", "negative"])
@pytest.mark.parametrize("key", ["output_tokens", "input_tokens_each_choice", "rows_computed", "rows_failed_by_class.json_parse"])
def test_a_status_figure_that_is_not_finite_and_non_negative_is_refused_by_name(tmp_path, bad, key):
    """status.json as another version or a damaged disk may leave it: NaN, Infinity or a
    negative count in a figure the report sums makes the file damaged (named with its key),
    never a NaN, infinite or negative total."""
    root = _finished(tmp_path)
    path = root / "state/shard_1/status.json"
    status = json.loads(path.read_text())
    where, _, name = ("stats." + key).rpartition(".")
    target = status
    for part in where.split("."):
        target = target.setdefault(part, {})
    target[name] = bad
    path.write_text(json.dumps(status))  # Python writes NaN and Infinity as JSON's readers take them
    entry = shard_states(root / "state", 3, LEASE)[1]
    assert entry.state == "failed" and entry.error.startswith(f"damaged state file {path}: stats.{key} is ")
    agg = report.compute_metrics(root / "state", 3)["aggregate"]
    assert agg["completed_shards"] == 1
    summed = [(k, v) for k, v in _figures(agg) if not (math.isfinite(v) and v >= 0)]
    assert summed == []


def test_aggregate_job_fails_on_a_damaged_status_json(tmp_path):
    """`python -m mirageflow.jobs aggregate` (the rule's command) exits non-zero, naming the file."""
    root = _finished(tmp_path)
    _damage(root / "state/shard_0/status.json", b"[]")
    code = (
        "import sys; from mirageflow.report.aggregate import write_report\n"
        "try:\n    write_report('state', 3)\n"
        "except Exception as e:\n    print(type(e).__name__, e, file=sys.stderr); sys.exit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 1 and "DamagedStateError" in proc.stderr and "state/shard_0/status.json" in proc.stderr


def test_status_json_with_a_different_shard_id_is_damaged(tmp_path):
    root = _finished(tmp_path)
    status = json.loads((root / "state/shard_0/status.json").read_text())
    atomic_write_json(root / "state/shard_1/status.json", status)  # copied from shard 0
    entry = shard_states(root / "state", 3, LEASE)[1]
    assert entry.state == "failed" and "shard_id is 0, not 1" in entry.error


def test_status_json_from_another_num_shards_still_refuses_the_report(tmp_path):
    root = _finished(tmp_path)
    status = json.loads((root / "state/shard_0/status.json").read_text())
    atomic_write_json(root / "state/shard_0/status.json", {**status, "num_shards": 8})
    with pytest.raises(ValueError, match="num_shards=8"):
        report.compute_metrics(root / "state", 3)
