"""The `mmirage` command line: each command on a finished run and on a half-finished state dir, and its exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fakes.configs import pipeline_config

from mirageflow import cli
from mirageflow.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]


def mmirage(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """As a script runs it: a separate process, exit code and output."""
    return subprocess.run([sys.executable, "-m", "mirageflow.cli", *args], cwd=cwd, capture_output=True, text=True)


def _pipeline(model, num_shards: int = 1, rows: int = 6, bad_lines: int = 1, **shard_params) -> dict:
    return pipeline_config(
        model=model, num_shards=num_shards, loading={"batch_size": 4}, outputs=[{"name": "a", "prompt": "Answer briefly: {{ q }}"}],
        processor={"backend": "transformers", "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 6}},
        processing={"remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
        shard_params={"max_error_rate": 0.5, **shard_params},
    )  # fmt: skip


def _workdir(root: Path, config: dict, rows: int = 6, bad_lines: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"q": f"question {i}"}) for i in range(rows)] + ["{not json"] * bad_lines
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    (root / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def finished(tiny_model, tmp_path_factory):
    """`mmirage run --stats` of a 1-shard pipeline (6 good rows, 1 bad line), run once for the module."""
    root = _workdir(tmp_path_factory.mktemp("cli") / "run", _pipeline(tiny_model))
    proc = mmirage(root, "run", "--config", "pipeline.yaml", "--stats", "--cores", "1")
    return root, proc


# --------------------------------------------------------------------------- a finished run


def test_run_runs_snakemake_and_passes_stats(finished):
    root, proc = finished
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mmirage: " in proc.stderr and "-m snakemake --snakefile" in proc.stderr and "--config stats=true" in proc.stderr
    status = json.loads((root / "state/shard_0/status.json").read_text())
    assert status["status"] == "success" and status["stats"]["rows_processed"] == 6 and status["stats"]["rows_failed"] == 1
    assert "GPU sampling off" in (root / "state/logs/shard_0.log").read_text()  # stats reached the job; no NVML here
    for name in ("metrics.json", "summary.md", "report.html", "merged/dataset_0.json"):
        assert (root / "state" / name).exists(), name
    progress = json.loads((root / "state/shard_0/progress.json").read_text())
    assert progress["phase"] == "done" and progress["rows_done"] == progress["rows_total"] == 7


def test_run_stats_on_a_finished_run_says_no_shard_will_run(finished):
    root, _ = finished
    proc = mmirage(root, "run", "--config", "pipeline.yaml", "--stats", "--cores", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every shard is done: --stats samples the GPUs of shards that run, and none will run now" in proc.stderr
    assert "rule shard" not in proc.stderr


def test_stats_prints_the_metrics_json(finished, tmp_path):
    root, _ = finished
    proc = mmirage(root, "stats", "--config", "pipeline.yaml", "--html", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(proc.stdout)
    assert {"per_shard", "aggregate", "cluster_accounting"} <= set(metrics)
    agg = metrics["aggregate"]
    assert (agg["completed_shards"], agg["total_rows_processed"], agg["total_rows_failed"]) == (1, 6, 1)
    assert agg["gpu_hours_remaining_estimate"] == 0.0 and agg["failed_shards"] == []
    assert metrics == json.loads((root / "state/metrics.json").read_text())  # what the aggregate rule wrote
    assert "data:image/svg+xml;base64," in (tmp_path / "r.html").read_text()


def test_status_of_a_finished_run(finished):
    root, _ = finished
    proc = mmirage(root, "status", "--config", "pipeline.yaml", "--all")
    assert proc.returncode == cli.EXIT_OK, proc.stdout + proc.stderr
    assert "done 1, running 0, failed 0, pending 0" in proc.stdout
    summary = json.loads(mmirage(root, "status", "--config", "pipeline.yaml", "--json").stdout)
    assert summary["done"] == 1 and summary["eta_seconds"] == 0 and summary["shards"][0]["state"] == "done"


def test_merge_of_a_finished_run_goes_through_snakemake(finished):
    root, _ = finished
    manifest = root / "state/merged/dataset_0.json"
    manifest.unlink()
    proc = mmirage(root, "merge", "--config", "pipeline.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--allowed-rules merge" in proc.stderr
    assert json.loads(manifest.read_text())["rows"] == 6
    assert "rule shard" not in proc.stderr  # never reruns a shard


def test_retry_of_a_finished_run_has_nothing_to_do_unless_failed_rows(finished):
    root, _ = finished
    proc = mmirage(root, "retry", "--config", "pipeline.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # nothing to retry and the report is current: it returns at once, Snakemake not started
    assert "no shard to rerun" in proc.stderr and "nothing to do" in proc.stderr and "-m snakemake" not in proc.stderr
    (root / "state/summary.md").unlink()  # a report to rebuild: the last step runs, no shard
    proc = mmirage(root, "retry", "--config", "pipeline.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no shard to rerun" in proc.stderr and "--allowed-rules aggregate merge dedup" in proc.stderr
    assert "rule aggregate" in proc.stderr and "rule shard" not in proc.stderr
    assert (root / "state/summary.md").exists()
    proc = mmirage(root, "retry", "--config", "pipeline.yaml", "--failed-rows", "--", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "--forcerun state/shard_0/status.json" in out and "retry_failed_rows=true" in out
    assert "rule shard:" in out or "shard" in out.split("Job stats:")[-1]


# --------------------------------------------------------------------------- a half-finished state dir


@pytest.fixture
def half(tmp_path, tiny_model):
    """4 shards by hand: 0 done, 1 failed (failure.json), 2 running (fresh progress.json), 3 pending."""
    root = _workdir(tmp_path / "half", _pipeline(tiny_model, num_shards=4))
    state = root / "state"
    atomic_write_json(state / "shard_0/status.json", {
        "shard_id": 0, "num_shards": 4, "status": "success", "attempt": 1, "hostname": "n0",
        "started_at": "2025-01-01T10:00:00+00:00", "finished_at": "2025-01-01T10:10:00+00:00",
        "stats": {"runtime_seconds": 600.0, "model_load_seconds": 30.0, "inference_runtime_seconds": 500.0, "rows_processed": 2,
                  "rows_failed": 0, "input_tokens": 40, "output_tokens": 12, "num_gpus": 1, "tokens_per_sec": 0.024},
    })  # fmt: skip
    atomic_write_json(state / "shard_1/failure.json", {
        "shard_id": 1, "status": "failed", "attempt": 2, "hostname": "n1", "slurm_job_id": "991",
        "error": "ShardInterrupted: interrupted by SIGTERM; 1 rows committed, rerun to resume", "signal": "SIGTERM",
    })  # fmt: skip
    atomic_write_json(state / "shard_2/progress.json", {
        "shard_id": 2, "phase": "generating", "rows_done": 1, "rows_total": 4, "fraction_done": 0.25,
        "rows_per_sec": 0.01, "tokens_per_sec": 0.1, "eta_seconds": 300.0, "eta_human": "00:05:00", "queue_depth": 3,
        "elapsed_seconds": 100.0, "num_gpus": 1, "hostname": "n2", "slurm_job_id": "992",
        "updated_at": "now", "updated_at_unix": time.time(),
    })  # fmt: skip
    return root


def test_status_of_a_half_finished_run(half):
    proc = mmirage(half, "status", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED, proc.stdout + proc.stderr
    out = proc.stdout
    assert "done 1, running 1, failed 1, pending 1" in out
    assert "SIGTERM" in out and "phase generating" in out and "ETA 00:05:00" in out and "queue 3" in out and "job 992" in out
    assert "mmirage retry --config pipeline.yaml" in out
    summary = json.loads(mmirage(half, "status", "--config", "pipeline.yaml", "--json").stdout)
    assert [s["state"] for s in summary["shards"]] == ["done", "failed", "running", "pending"]
    # no index yet: the run's size is unknown, so no ETA (state/remaining.py run_progress, as the live line)
    assert summary["eta_seconds"] is None and summary["eta_note"] == "the run's size is not indexed yet"
    assert (summary["rows_done"], summary["rate"]) == (3, 0.01)  # the done shard's 2 rows + the running one's 1
    atomic_write_json(half / "state/datasets/dataset_0.index.json", {"rows": 16, "num_shards": 4})
    summary = json.loads(mmirage(half, "status", "--config", "pipeline.yaml", "--json").stdout)
    # the 13 rows left (the shards not started included) at the running shard's 0.01 rows/s
    assert summary["eta_seconds"] == pytest.approx(13 / 0.01) and summary["eta_human"] == "00:21:40"
    assert summary["gpu_hours_remaining_estimate"] == pytest.approx(600 * (0.75 + 1 + 1) / 3600)

    (half / "state/shard_1/failure.json").unlink()  # now nothing failed: incomplete
    assert mmirage(half, "status", "--config", "pipeline.yaml").returncode == cli.EXIT_INCOMPLETE


def test_stats_of_a_half_finished_run(half):
    proc = mmirage(half, "stats", "--config", "pipeline.yaml")
    assert proc.returncode == 0, proc.stderr
    agg = json.loads(proc.stdout)["aggregate"]
    assert (agg["completed_shards"], agg["missing_shards"]) == (1, [1, 2, 3])
    assert agg["failed_shards"][0]["shard_id"] == 1 and agg["failed_shards"][0]["signal"] == "SIGTERM"
    assert (agg["running_shards"], agg["pending_shards"]) == ([2], [3])
    assert agg["gpu_hours_remaining_estimate"] == pytest.approx(600 * 2.75 / 3600)
    assert not (half / "state/metrics.json").exists()  # stats only reads


def test_merge_refuses_while_shards_are_missing(half):
    proc = mmirage(half, "merge", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED and "failed: [1]" in proc.stderr and "snakemake" not in proc.stderr
    (half / "state/shard_1/failure.json").unlink()
    proc = mmirage(half, "merge", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_INCOMPLETE and "pending: [1, 3]" in proc.stderr and "running: [2]" in proc.stderr
    assert not (half / "out/merged").exists()


def test_retry_reruns_the_unfinished_shards(half):
    proc = mmirage(half, "retry", "--config", "pipeline.yaml", "--", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "retrying 3 unfinished shard(s) [1, 2, 3]" in out and "[2] look alive" in out
    assert "--forcerun" not in out  # no --failed-rows: done shards are left alone
    assert "state/shard_1/status.json" in out and "state/shard_3/status.json" in out


def test_retry_plan_forces_only_done_shards_with_failed_rows(half, monkeypatch):
    monkeypatch.chdir(half)  # state_dir is relative, as in the commands
    status = json.loads((half / "state/shard_0/status.json").read_text())
    status["stats"]["rows_failed"] = 2
    atomic_write_json(half / "state/shard_0/status.json", status)
    cfg = cli._load("pipeline.yaml", check_paths=False)
    assert cli.retry_plan(cfg, failed_rows=False)["with_failed_rows"] == []
    plan = cli.retry_plan(cfg, failed_rows=True)
    assert {k: plan[k] for k in ("unfinished", "running", "with_failed_rows", "damaged_status", "stale")} == {
        "unfinished": [1, 2, 3],
        "running": [2],
        "with_failed_rows": [0],
        "damaged_status": [],
        "stale": [],
    }


def test_retry_forces_a_shard_whose_status_json_is_damaged(half, monkeypatch):
    """Snakemake sees the damaged status.json and would skip the shard: retry forces it."""
    (half / "state/shard_0/status.json").write_text("[]")
    monkeypatch.chdir(half)
    plan = cli.retry_plan(cli._load("pipeline.yaml", check_paths=False), failed_rows=False)
    assert plan["damaged_status"] == [0] and plan["unfinished"] == [0, 1, 2, 3]
    proc = mmirage(half, "retry", "--config", "pipeline.yaml", "--", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "retrying 4 unfinished shard(s) [0, 1, 2, 3]" in out and "--forcerun state/shard_0/status.json" in out
    proc = mmirage(half, "status", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED and "done 0, running 1, failed 2, pending 1" in proc.stdout
    assert "damaged state file state/shard_0/status.json" in proc.stdout and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- errors and exit codes


def test_a_bad_config_is_exit_code_2_before_anything_starts(tmp_path, tiny_model, monkeypatch, capsys):
    cfg = _pipeline(tiny_model)
    cfg["loading_params"]["num_shard"] = 2
    root = _workdir(tmp_path / "bad", cfg)
    proc = mmirage(root, "run", "--config", "pipeline.yaml")  # once as a script
    assert proc.returncode == cli.EXIT_USAGE and "did you mean 'num_shards'?" in proc.stderr and "snakemake" not in proc.stderr
    monkeypatch.chdir(root)
    for command in ("run", "submit", "retry", "stats", "status", "merge", "check"):
        assert cli.main([command, "--config", "pipeline.yaml"]) == cli.EXIT_USAGE, command
        err = capsys.readouterr().err
        assert "loading_params.num_shard: unknown key (did you mean 'num_shards'?)" in err and "snakemake" not in err
    assert cli.main(["status", "--config", "missing.yaml"]) == cli.EXIT_USAGE
    assert "No such file" in capsys.readouterr().err
    assert cli.main(["status", "--config", "pipeline.yaml", "--", "--dry-run"]) == cli.EXIT_USAGE
    for argv in (["status"], ["frobnicate", "--config", "pipeline.yaml"]):  # argparse: --config required, unknown command
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == cli.EXIT_USAGE
    assert not (root / "state").exists() and not (root / ".snakemake").exists()


def test_a_failed_run_is_exit_code_1(tmp_path, tiny_model):
    root = tmp_path / "fail"
    root.mkdir()
    (root / "in.parquet").write_bytes(b"this is not a parquet file")  # the index job fails, fast
    cfg = _pipeline(tiny_model)
    cfg["loading_params"]["datasets"][0].update(path="in.parquet", type="parquet")
    (root / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    proc = mmirage(root, "run", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr[-3000:]
    assert "mmirage: snakemake exited with status 1" in proc.stderr


def test_snakemake_command_shape(monkeypatch):
    cmd = cli.snakemake_command("my.yaml", stats=True, cores="4", extra=["--dry-run"])
    assert cmd[1:] == ["-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--configfile", "my.yaml",
                       "--config", "stats=true", "--cores", "4", "--dry-run"]  # fmt: skip
    cmd = cli.snakemake_command("my.yaml", profile=REPO / "profiles/slurm")
    assert "--profile" in cmd and "--cores" not in cmd and "--config" not in cmd
    monkeypatch.setenv("MIRAGEFLOW_WORKFLOW_DIR", str(REPO))
    assert cli.workflow_dir() == REPO


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"mmirage": "mirageflow.cli:main"}
    help_text = subprocess.run([sys.executable, "-m", "mirageflow.cli", "--help"], capture_output=True, text=True).stdout
    assert "exit codes:" in help_text and "3  incomplete" in help_text


# --------------------------------------------------------------------------- what status and retry say (issue 15)


def test_status_of_a_cpu_run_shows_no_gpu_hours(finished):
    root, _ = finished
    out = mmirage(root, "status", "--config", "pipeline.yaml").stdout
    assert "GPU-hours" not in out and "(CPU run)" in out
    assert f"state_dir {(root / 'state').resolve()}: 1 shards" in out


def test_status_of_a_gpu_run_shows_gpu_hours(half):
    out = mmirage(half, "status", "--config", "pipeline.yaml").stdout
    assert "GPU-hours remaining 0.46" in out and "CPU run" not in out


def test_status_from_another_directory_says_the_state_dir_does_not_exist(half, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in ("status", "stats"):
        proc = mmirage(elsewhere, command, "--config", str(half / "pipeline.yaml"))
        assert proc.returncode == cli.EXIT_USAGE, proc.stdout + proc.stderr
        assert f"state_dir {elsewhere / 'state'} does not exist" in proc.stderr
        assert "relative to the directory mmirage runs in" in proc.stderr and "pending" not in proc.stdout + proc.stderr


def test_status_prints_whole_errors_and_does_not_suggest_a_retry_that_would_fail_the_same_way(half):
    long_path = "state/" + "x" * 300 + "/errors.jsonl"
    atomic_write_json(half / "state/shard_1/failure.json", {
        "shard_id": 1, "status": "failed", "attempt": 1, "signal": None,
        "error": f"ShardFailed: every row of shard 1: 2 of 2 rows failed (template_error: 2); see {long_path}",
        "stats": {"rows_processed": 0, "rows_failed": 2, "rows_failed_by_class": {"template_error": 2}},
    })  # fmt: skip
    proc = mmirage(half, "status", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED
    out = proc.stdout
    assert long_path in out  # not cut off
    assert "shard 1: every failed row failed with template_error" in out and "a retry would fail the same way" in out
    assert "mmirage retry" not in out
    summary = json.loads(mmirage(half, "status", "--config", "pipeline.yaml", "--json").stdout)
    assert summary["failures_repeat"] == {"1": "template_error"} and summary["shards"][1]["repeats_identically"] == "template_error"
    # a failure a retry can fix still gets the suggestion
    atomic_write_json(
        half / "state/shard_3/failure.json", {"shard_id": 3, "status": "failed", "error": "EngineFailed: lost the server", "signal": None}
    )
    out = mmirage(half, "status", "--config", "pipeline.yaml").stdout
    assert "retry the failed shards (the others) with: mmirage retry --config pipeline.yaml" in out


def test_retry_exits_non_zero_when_shards_are_still_failed(half, monkeypatch, capsys):
    monkeypatch.chdir(half)
    ran = []
    monkeypatch.setattr(cli, "_run", lambda cmd: ran.append(cmd) or cli.EXIT_OK)  # Snakemake "succeeded" but left shard 1 failed
    assert cli.main(["retry", "--config", "pipeline.yaml"]) == cli.EXIT_FAILED
    assert "shard(s) [1] still failed after the retry" in capsys.readouterr().err
    assert cli.main(["retry", "--config", "pipeline.yaml", "--", "--dry-run"]) == cli.EXIT_OK  # a dry run changes nothing
    (half / "state/shard_1/failure.json").unlink()
    assert cli.main(["retry", "--config", "pipeline.yaml"]) == cli.EXIT_OK
    assert len(ran) == 4  # the shards named, then (nothing failed any more) the report without any shard
    assert ran[-2][ran[-2].index("--cores") + 2 :][:3] == [
        "state/shard_1/status.json",
        "state/shard_2/status.json",
        "state/shard_3/status.json",
    ]
    assert "--allowed-rules" in ran[-1] and not any("shard_" in a for a in ran[-1])


def test_retry_warns_when_a_failure_will_repeat(half, monkeypatch, capsys):
    monkeypatch.chdir(half)
    monkeypatch.setattr(cli, "_run", lambda cmd: cli.EXIT_OK)
    atomic_write_json(half / "state/shard_1/failure.json", {
        "shard_id": 1, "status": "failed", "signal": None, "error": "ShardFailed: every row of shard 1: 2 of 2 rows failed (missing_variable: 2)",
        "stats": {"rows_processed": 0, "rows_failed": 2, "rows_failed_by_class": {"missing_variable": 2}},
    })  # fmt: skip
    cli.main(["retry", "--config", "pipeline.yaml"])
    assert "shard 1: every failed row failed with missing_variable" in capsys.readouterr().err


def test_a_snakemake_flag_without_the_separator_gets_a_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_run", lambda cmd: pytest.fail("nothing may run"))
    assert cli.main(["run", "--config", "my.yaml", "--dry-run", "-p"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments: --dry-run -p" in err and "mmirage run --config my.yaml -- --dry-run -p" in err
    assert cli.main(["status", "--config", "my.yaml", "--bogus"]) == cli.EXIT_USAGE
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# --------------------------------------------------------------------------- MMIRAGE's flags and commands (issue 21)


def _recorded(monkeypatch, rc: int = cli.EXIT_OK) -> list[list[str]]:
    """Snakemake commands the CLI would run (not run)."""
    ran: list[list[str]] = []
    monkeypatch.setattr(cli, "_run", lambda cmd: ran.append(cmd) or rc)
    return ran


def test_check_before_any_run_validates_and_says_nothing_ran(tmp_path, tiny_model):
    root = _workdir(tmp_path / "fresh", _pipeline(tiny_model))
    proc = mmirage(root, "check", "--config", "pipeline.yaml", "--log-level", "INFO")
    assert proc.returncode == cli.EXIT_OK, proc.stdout + proc.stderr
    assert "pipeline.yaml: valid" in proc.stdout and "no state yet" in proc.stdout and "nothing has run" in proc.stdout
    assert not (root / "state").exists()  # check writes nothing


def test_check_after_a_run_is_the_shards_status(finished):
    root, _ = finished
    proc = mmirage(root, "check", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_OK, proc.stdout + proc.stderr
    assert "shards: 1 of 1 done, 0 running, 0 failed, 0 pending" in proc.stdout


def test_check_and_publish_is_safe_while_shards_failed_or_pending(half):
    """MMIRAGE's `mmirage check --config C && publish`: non-zero unless every shard succeeded."""
    proc = mmirage(half, "check", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_FAILED, proc.stdout + proc.stderr
    assert "shards: 1 of 4 done, 1 running, 1 failed, 1 pending" in proc.stdout
    assert "interrupted by SIGTERM" in proc.stdout  # the failed shard's line
    (half / "state/shard_1/failure.json").unlink()
    proc = mmirage(half, "check", "--config", "pipeline.yaml")
    assert proc.returncode == cli.EXIT_INCOMPLETE, proc.stdout + proc.stderr


def test_check_retry_asks_first_and_retries_with_yes(half, monkeypatch, capsys):
    monkeypatch.chdir(half)
    ran = _recorded(monkeypatch)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # not a terminal: no one to ask
    assert cli.main(["check", "--config", "pipeline.yaml", "--retry"]) == cli.EXIT_FAILED
    assert "stdin is not a terminal: add -y" in capsys.readouterr().err and ran == []
    assert cli.main(["check", "--config", "pipeline.yaml", "--retry", "-y", "--stats"]) == cli.EXIT_FAILED  # still failed after it
    (cmd,) = ran
    assert "--rerun-incomplete" in cmd and "stats=true" in cmd and "--cores" in cmd


def test_run_shard_id_force_retry_and_the_slurm_mode(half, monkeypatch):
    monkeypatch.chdir(half)
    ran = _recorded(monkeypatch)
    assert cli.main(["run", "--config", "pipeline.yaml", "--shard-id", "2", "--force-retry"]) == cli.EXIT_OK
    cmd = ran.pop()
    assert cmd[cmd.index("--cores") + 1 : cmd.index("--cores") + 3] == ["1", "state/shard_2/status.json"]
    assert cmd[cmd.index("--retries") + 1] == "3"  # execution_params.max_retries
    assert cli.main(["run", "--config", "pipeline.yaml", "--shard-id", "4"]) == cli.EXIT_USAGE and not ran
    cfg = yaml.safe_load((half / "pipeline.yaml").read_text())
    cfg["execution_params"] = {"mode": "slurm", "retry": True, "max_retries": 2}
    (half / "slurm.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", "--config", "slurm.yaml"]) == cli.EXIT_OK
    cmd = ran.pop()
    assert "--profile" in cmd and "--cores" not in cmd and cmd[cmd.index("--retries") + 1] == "2"
    assert cli.main(["run", "--config", "slurm.yaml", "--local"]) == cli.EXIT_OK
    assert "--profile" not in ran.pop()
    assert cli.main(["retry", "--config", "slurm.yaml", "-y"]) == cli.EXIT_FAILED  # shard 1 still failed
    assert "--profile" in ran.pop()


def test_submit_shard_ids_and_wait(half, monkeypatch, capsys):
    monkeypatch.chdir(half)
    ran = _recorded(monkeypatch)
    assert cli.main(["submit", "--config", "pipeline.yaml", "--shard-ids", "3,1"]) == cli.EXIT_OK
    cmd = ran.pop()
    profile = cmd.index("--profile")
    assert cmd[profile + 2 : profile + 4] == ["state/shard_1/status.json", "state/shard_3/status.json"]
    assert cli.main(["submit", "--config", "pipeline.yaml", "--shard-ids", "3,1", "--wait"]) == cli.EXIT_FAILED  # shard 1 failed
    for bad in ("1,x", "7", ","):
        assert cli.main(["submit", "--config", "pipeline.yaml", "--shard-ids", bad]) == cli.EXIT_USAGE, bad
    assert "invalid shard id 'x'" in capsys.readouterr().err


def test_merge_output_root_and_merge_dir(finished, tmp_path):
    root, _ = finished
    merged = sorted((root / "out/merged").glob("part-*"))
    proc = mmirage(root, "merge", "--config", "pipeline.yaml", "--output-root", str(tmp_path / "pub"), "--output-path", "x.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--output-path is ignored: here a batch_api shard waits for its batches and writes real records" in proc.stderr
    copied = sorted((tmp_path / "pub" / "out").glob("part-*"))
    assert [p.read_bytes() for p in copied] == [p.read_bytes() for p in merged] and copied
    proc = mmirage(root, "merge", "--config", "pipeline.yaml", "--output-dir", str(tmp_path / "pub"))
    assert proc.returncode == cli.EXIT_USAGE and "exists and is not empty; nothing is replaced" in proc.stderr
    # merge-dir: the shard outputs, no config
    proc = mmirage(root, "merge-dir", "--input-dir", "out", "--output-dir", str(tmp_path / "md"))
    assert proc.returncode == 0, proc.stderr
    assert "merged 1 shard(s)" in proc.stdout and "completeness is not checked" in proc.stderr
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "md").to_pylist() == pq.read_table(root / "out/merged").to_pylist()
    # a folder of datasets: each one with shard outputs (not the state_dir's shard_* folders) into md2/<its name>
    proc = mmirage(root, "merge-dir", "--input-dir", ".", "--output-dir", str(tmp_path / "md2"))
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(tmp_path / "md2" / "out").to_pylist() == pq.read_table(root / "out/merged").to_pylist()
    assert sorted(p.name for p in (tmp_path / "md2").iterdir()) == ["out"]
    proc = mmirage(root, "merge-dir", "--input-dir", "out", "--output-dir", "out/inside")
    assert proc.returncode == cli.EXIT_FAILED and "inside --input-dir" in proc.stderr


def test_run_export_prompts_writes_the_requests_and_runs_nothing(finished, tmp_path):
    root, _ = finished
    proc = mmirage(root, "run", "--config", "pipeline.yaml", "--export-prompts", str(tmp_path / "prompts.jsonl"))
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr  # the bad line is a row error, written as such
    (path,) = tmp_path.glob("prompts.*.jsonl")
    assert proc.stdout.strip() == str(path) and "snakemake" not in proc.stderr
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    requests = [x for x in lines if "error" not in x]
    assert [x["source_index"] for x in requests] == list(range(6)) and {x["output"] for x in requests} == {"a"}
    assert requests[0]["prompt"].endswith("<|im_start|>assistant\n") and "Answer briefly: question 0" in requests[0]["prompt"]
    assert requests[0]["sampling_params"]["max_new_tokens"] == 6 and requests[0]["needs"] == []
    (error,) = [x for x in lines if "error" in x]
    assert error["source_index"] == 6 and error["error"]["error"] == "bad_row"
    mmirage(root, "run", "--config", "pipeline.yaml", "--export-prompts", str(tmp_path))
    assert len(list(tmp_path.glob("exported_prompts.*.jsonl"))) == 1  # a directory: a new file in it


def test_merge_dir_over_a_file_that_is_not_parquet_names_the_file(tmp_path, capsys):
    """Item 19: no pyarrow traceback; the file is named."""
    bad = tmp_path / "in" / "shard_0" / "part-00000.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_text("this is not parquet\n")
    assert cli.main(["merge-dir", "--input-dir", str(tmp_path / "in"), "--output-dir", str(tmp_path / "md")]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{bad}: cannot read this Parquet part file" in err and "Traceback" not in err, err
    bad.with_suffix(".parquet").unlink()
    (bad.parent / "part-00000.jsonl").write_text('not json\n{"source_index": 0}\n')
    assert cli.main(["merge-dir", "--input-dir", str(tmp_path / "in"), "--output-dir", str(tmp_path / "md")]) == cli.EXIT_FAILED
    assert f"{bad.parent / 'part-00000.jsonl'}:1: not a JSON record" in capsys.readouterr().err


def test_a_negative_shard_id_says_so_and_names_the_flag(half, monkeypatch, capsys):
    """Item 19: `--shard-id -1` is not "expected integers, e.g. --shard-ids 0,2"."""
    monkeypatch.chdir(half)
    ran = _recorded(monkeypatch)
    assert cli.main(["run", "--config", "pipeline.yaml", "--shard-id", "-1"]) == cli.EXIT_USAGE and not ran
    err = capsys.readouterr().err
    assert "--shard-id -1: a shard id is not negative; the pipeline has shards 0 to 3" in err, err
    assert cli.main(["submit", "--config", "pipeline.yaml", "--shard-ids", "0,-2"]) == cli.EXIT_USAGE and not ran
    assert "--shard-ids -2: a shard id is not negative" in capsys.readouterr().err
