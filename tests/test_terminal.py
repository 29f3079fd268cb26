"""What the driver prints: live progress lines from progress.json, and the end-of-run summary."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_workflow
from fakes.configs import pipeline_config

from mirageflow import cli
from mirageflow.report import terminal
from mirageflow.state.remaining import running_rate, shard_rate
from mirageflow.files import atomic_write_json


def _progress(**kw) -> dict:
    base = {"phase": "generating", "rows_done": 0, "rows_total": 10, "rows_per_sec": None, "tokens_per_sec": None,
            "phase_seconds": 3.0, "updated_at_unix": time.time()}  # fmt: skip
    return base | kw


def _status(rows_ok: int, rows_failed: int = 0, num_gpus: int = 0) -> dict:
    return {
        "status": "success", "started_at": "2025-01-01T10:00:00+00:00", "finished_at": "2025-01-01T10:01:00+00:00",
        "stats": {"runtime_seconds": 60.0, "inference_runtime_seconds": 50.0, "output_tokens": 500, "num_gpus": num_gpus,
                  "rows_processed": rows_ok, "rows_failed": rows_failed,
                  "rows_failed_by_class": {"json_parse": rows_failed} if rows_failed else {}},
    }  # fmt: skip


def _state(tmp_path: Path, rows: int = 40) -> Path:
    state = tmp_path / "state"
    atomic_write_json(state / "datasets/dataset_0.index.json", {"rows": rows, "num_shards": 4})
    return state


# --------------------------------------------------------------------------- live progress


def test_progress_line_sums_the_running_shards(tmp_path):
    state = _state(tmp_path)
    atomic_write_json(state / "shard_0/status.json", _status(9, 1))
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_done=4, rows_per_sec=2.0, tokens_per_sec=100.0))
    atomic_write_json(state / "shard_2/progress.json", _progress(rows_done=2, rows_per_sec=1.0, tokens_per_sec=50.0))
    live = terminal.LiveProgress(state, 4, 1.0, lambda s: None)
    line = live.line()
    assert line.startswith("mirageflow: shards 1/4 done, 2 running")
    assert "rows 16/40 (40%)" in line  # 10 of the done shard, 4 + 2 running
    assert "3.00 rows/s, 150 tok/s" in line
    assert "ETA 00:00:08" in line  # 24 rows left at 3 rows/s


def test_progress_line_shows_the_dollars_spent_and_the_runs_forecast(tmp_path):
    state = _state(tmp_path)
    done = _status(10)
    done["stats"]["cost_usd"] = 1.5
    atomic_write_json(state / "shard_0/status.json", done)
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_done=10, rows_per_sec=2.0, cost_usd=0.5))
    line = terminal.LiveProgress(state, 4, 1.0, lambda s: None).line()
    assert line.endswith("$2.00 spent, ~$4.00 forecast (from 20 rows done)")  # 40 rows at $0.10 a row
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_done=10, rows_per_sec=2.0, cost_usd=0.5, unpriced_tokens=7))
    assert (
        "$2.00 spent + unknown, ~$4.00 forecast (from 20 rows done, 7 tokens of unknown price left out)"
        in terminal.LiveProgress(state, 4, 1.0, lambda s: None).line()
    )


def test_progress_line_names_the_phase_of_a_single_shard_and_says_nothing_when_none_runs(tmp_path):
    state = _state(tmp_path)
    live = terminal.LiveProgress(state, 4, 1.0, lambda s: None)
    assert live.line() is None  # nothing runs: no line
    atomic_write_json(state / "shard_3/progress.json", _progress(phase="loading", phase_seconds=42.0))
    line = live.line()
    assert "1 running (loading 42 s)" in line and "ETA n/a" in line
    # a progress.json that stopped updating is no running shard
    old = time.time() - 3600
    os.utime(state / "shard_3/progress.json", (old, old))
    assert live.line() is None


def test_progress_thread_prints_at_most_every_interval_and_never_repeats_a_line(tmp_path):
    state = _state(tmp_path)
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_done=4, rows_per_sec=2.0))
    lines: list[str] = []
    live = terminal.LiveProgress(state, 4, 0.05, lines.append)
    live.start()
    time.sleep(0.4)
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_done=6, rows_per_sec=2.0))
    time.sleep(0.3)
    live.stop()
    assert len(lines) == 2, lines  # the same line is not printed twice
    assert "rows 4/40" in lines[0] and "rows 6/40" in lines[1]


def test_progress_with_several_samples_counts_rows_and_samples_apart_and_never_passes_100_percent(tmp_path):
    """n_samples 2, 60 rows in 4 shards: the issue's line read "rows 76/60 (127%)"."""
    state = _state(tmp_path, rows=60)
    atomic_write_json(state / "shard_0/status.json", _status(30))  # 15 rows x 2 samples
    atomic_write_json(state / "shard_1/progress.json", _progress(
        rows_done=5, rows_total=15, samples_done=11, samples_total=30, n_samples=2, samples_per_sec=2.0, rows_per_sec=1.0,
    ))  # fmt: skip
    live = terminal.LiveProgress(state, 4, 1.0, lambda s: None, n_samples=2)
    line = live.line()
    assert "rows 20/60, samples 41/120 (34%)" in line and "2.00 samples/s" in line
    assert "ETA 00:00:39" in line or "ETA 00:00:40" in line  # 79 samples left at 2 samples/s
    for shard in (1, 2):
        atomic_write_json(state / f"shard_{shard}/status.json", _status(30))
    # the last shard writes its last part; its progress.json is of the format before samples were counted apart
    atomic_write_json(state / "shard_3/progress.json", _progress(phase="writing", rows_done=30, rows_total=30, rows_per_sec=1.0))
    line = terminal.LiveProgress(state, 4, 1.0, lambda s: None, n_samples=2).line()
    assert "rows 60/60, samples 120/120 (100%)" in line


def test_progress_says_so_when_no_rate_is_measured_instead_of_zero(tmp_path):
    """The demo: a shard's 12 rows are one batch in flight, so nothing finishes for a while."""
    state = _state(tmp_path, rows=36)
    atomic_write_json(state / "shard_0/progress.json", _progress(rows_total=12, rows_per_sec=None, inflight=12))
    clock = {"now": 1000.0}
    live = terminal.LiveProgress(state, 3, 1.0, lambda s: None, clock=lambda: clock["now"])
    line = live.line()
    assert "rows 0/36 (0%), 12 in flight" in line and "rows/s n/a (nothing finished yet)" in line
    assert "ETA n/a (no rate yet)" in line and "0.00" not in line
    # the batch returns and the shard is done; the next one's batch is in flight: still no rate (the one
    # derivation, state/remaining.py: no guess from what this thread saw finish), until the shard measures one
    clock["now"] = 1040.0
    atomic_write_json(state / "shard_0/status.json", _status(12))
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_total=12, rows_per_sec=None, inflight=12))
    line = live.line()
    assert "rows 12/36 (33%), 12 in flight" in line and "rows/s n/a (nothing finished yet)" in line and "ETA n/a (no rate yet)" in line
    atomic_write_json(state / "shard_1/progress.json", _progress(rows_done=6, rows_total=12, rows_per_sec=0.5, rate_window_seconds=12))
    line = live.line()
    assert "rows 18/36 (50%)" in line and "0.50 rows/s" in line and "ETA 00:00:36" in line  # 18 rows at 0.5 rows/s


def test_the_live_line_and_mmirage_status_show_the_same_rates_of_the_same_files(tmp_path):
    """One derivation (state/remaining.py): status shows each running shard's rate, the live line their sum."""
    state = _state(tmp_path)
    progress = {
        1: _progress(rows_done=4, samples_per_sec=2.5, rows_per_sec=2.5, tokens_per_sec=100.0),
        2: _progress(rows_done=2, rows_per_sec=1.5, tokens_per_sec=50.0),  # written before samples were counted apart
        3: _progress(phase="loading"),  # not generating: no rate to wait for
    }
    for shard, p in progress.items():
        atomic_write_json(state / f"shard_{shard}/progress.json", p)
    status = [cli._status_line({"shard_id": i, "state": "running", "progress": p}) for i, p in progress.items()]
    assert "2.500 rows/s, 100.0 tok/s" in status[0] and "1.500 rows/s, 50.000 tok/s" in status[1]
    assert [shard_rate(p) for p in progress.values()] == [2.5, 1.5, None]
    assert running_rate(list(progress.values())) == (4.0, 150.0)
    line = terminal.LiveProgress(state, 4, 1.0, lambda s: None).line()
    assert "4.00 rows/s, 150 tok/s" in line and "ETA 00:00:08" in line  # 34 rows left at 4 rows/s: 8.5 s
    progress[2]["rows_per_sec"] = None  # a generating shard without a rate: no sum (the thread's window has seen nothing)
    assert running_rate(list(progress.values())) is None


def _reporter(state: Path, shard_id: int, rows_total: int, clock: dict):
    """A shard's progress.json writer (shard/progress.py), on a clock the test moves."""
    from mirageflow.shard.progress import ProgressReporter

    snap = {"samples_done": 0, "output_tokens": 0}
    reporter = ProgressReporter(state / f"shard_{shard_id}/progress.json", shard_id, rows_total, lambda: dict(snap),
                                clock=lambda: clock["now"])  # fmt: skip

    def write(phase: str, samples: int = 0, tokens: int = 0) -> None:
        snap.update(samples_done=samples, output_tokens=tokens)
        reporter.set_phase(phase)
        reporter.write()

    return write


def test_the_live_line_and_mmirage_status_show_the_same_progress_rate_and_eta_of_the_same_files(tmp_path, monkeypatch, capsys):
    """Issue 35: one derivation of the run's rate and ETA (state/remaining.py run_progress): the live line and
    `mmirage status` read the same files to the same texts and numbers, whatever the shards are doing."""
    import shutil

    from mirageflow.state.shards import states_of

    monkeypatch.chdir(tmp_path)
    state = _state(tmp_path)  # 40 rows, 10 a shard
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(40)))
    raw = pipeline_config(num_shards=4, processor={"backend": "openai", "base_url": "http://127.0.0.1:9/v1"})
    (tmp_path / "pipeline.yaml").write_text(json.dumps(raw))
    cfg = cli._load("pipeline.yaml", check_paths=False)

    def shown(live_line: bool = True):
        """(the live line's ETA part, `mmirage status`'s text, its --json, the one derivation's figures)"""
        line = terminal.LiveProgress(state, 4, 1.0, lambda s: None).line()
        cli.main(["status", "--config", "pipeline.yaml"])
        text = capsys.readouterr().out
        cli.main(["status", "--config", "pipeline.yaml", "--json"])
        summary = json.loads(capsys.readouterr().out)
        if live_line:  # the two agree before the function is asked
            eta = line.split(" | ")[3]
            assert eta.startswith("ETA") and eta in text, (line, text)
        else:
            assert line is None
        from mirageflow.state.remaining import indexed_rows, status_progress

        progress = status_progress(states_of(cfg), 1, indexed_rows(state))
        for part in (progress.work_text(), progress.rate_text(), progress.eta_text()):
            assert (line is None or part in line) and part in text, (part, line, text)
        assert progress.eta_seconds == summary["eta_seconds"]
        return progress

    # shard 0 done; shard 1 resumed with 4 rows from its checkpoint and made 4 more in 20 s; shard 2 made 2 in 10 s
    clock = {"now": 0.0}
    shard_1, shard_2, shard_3 = (_reporter(state, i, 10, clock) for i in (1, 2, 3))
    atomic_write_json(state / "shard_0/status.json", _status(10))
    shard_1("generating", 4)
    clock["now"] = 10.0
    shard_2("generating")
    clock["now"] = 20.0
    shard_1("generating", 8, 80)
    shard_2("generating", 2, 40)
    progress = shown()
    # 20 rows left (shard 3's, not started, included) at 0.2 + 0.2 rows/s: the checkpoint's rows are no speed
    assert progress.eta_seconds == pytest.approx(50.0) and progress.eta_text() == "ETA 00:00:50"
    assert progress.work_text() == "rows 20/40 (50%)" and progress.rate_text() == "0.40 rows/s, 8.00 tok/s"
    # shard 3 starts generating and nothing of it finished yet: no run rate (a sum without it would undercount)
    shard_3("generating")
    progress = shown()
    assert progress.rate_text() == "rows/s n/a (1 of 3 generating shards have no rate yet)"
    assert progress.eta_text() == "ETA n/a (no rate yet)" and progress.eta_seconds is None
    # no shard started: no live line; status and the function know no rate and no ETA
    for shard in range(4):
        shutil.rmtree(state / f"shard_{shard}")
    assert shown(live_line=False).eta_text() == "ETA n/a (no shard running)"
    # shard 1 loads its model: not generating yet
    shard_1("loading")
    progress = shown()
    assert progress.rate_text() == "rows/s n/a (not generating yet)" and progress.eta_text() == "ETA n/a (no rate yet)"


def test_progress_interval_is_short_on_a_terminal_long_in_a_log_and_can_be_set():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert terminal.progress_interval(Tty(), environ={}) == terminal.TTY_INTERVAL
    assert terminal.progress_interval(io.StringIO(), environ={}) == terminal.LOG_INTERVAL == 60.0
    assert terminal.progress_interval(io.StringIO(), environ={terminal.ENV_INTERVAL: "5"}) == 5.0
    assert terminal.progress_interval(io.StringIO(), environ={terminal.ENV_INTERVAL: "0"}) == 0.0


def test_hooks_do_nothing_outside_the_driver(tmp_path, monkeypatch):
    """A cluster job re-parsing the Snakefile is not the main process: no thread, no summary."""
    printed = []
    monkeypatch.setattr(terminal, "_emit", lambda text, error=False: printed.append(text))
    monkeypatch.setenv(terminal.ENV_INTERVAL, "1")
    pipeline = SimpleNamespace(
        state_dir=str(tmp_path), num_shards=1, n_samples=1, datasets=[], merge=True, shard=SimpleNamespace(lease_timeout_seconds=300)
    )
    job = SimpleNamespace(is_main_process=False, configfiles=["p.yaml"])
    terminal.on_start(pipeline, job)
    assert terminal._LIVE is None
    terminal.on_error(pipeline, job)
    terminal.on_success(pipeline, job)
    assert printed == []
    driver = SimpleNamespace(is_main_process=True, configfiles=["p.yaml"])
    terminal.on_start(pipeline, driver)
    assert terminal._LIVE is not None and terminal._LIVE._thread.is_alive()
    thread = terminal._LIVE._thread
    terminal.on_error(pipeline, driver)
    assert terminal._LIVE is None and not thread.is_alive()
    assert printed and printed[0].startswith("mirageflow: run FAILED")


def test_targets_not_done_names_only_the_targeted_shards_that_are_not_a_current_success(tmp_path, monkeypatch):
    """The end-of-run guard without Snakemake: shard 0 done, shard 1 stale (another records
    fingerprint), shard 2 never run; the headline names the targeted ones not done."""
    monkeypatch.chdir(tmp_path)
    state = _state(tmp_path)
    atomic_write_json(state / "records.fingerprint", {"sha256": "now"})
    atomic_write_json(state / "shard_0/status.json", _status(10) | {"records_fingerprint": "now"})
    atomic_write_json(state / "shard_1/status.json", _status(10) | {"records_fingerprint": "before"})
    pipeline = SimpleNamespace(state_dir="state", num_shards=3, shard=SimpleNamespace(lease_timeout_seconds=300))

    assert terminal.targets_not_done(pipeline, [0], "p.yaml") == (None, 0)
    assert terminal.targets_not_done(pipeline, [], "p.yaml") == (None, 0)
    text, code = terminal.targets_not_done(pipeline, [0, 1, 2], "p.yaml")
    assert code == 3 and text.startswith("mirageflow: run NOT complete: 2 of the 3 shard(s) it targeted are not done")
    assert "(shard 1 not run: its status.json is an earlier config's; shard 2 not run)" in text
    assert text.endswith("Continue with: mmirage retry --config p.yaml (it reruns exactly the shards not done).")
    text, _ = terminal.targets_not_done(pipeline, [2], None)  # no config file: the same command, forcing the shard
    assert "1 of the 1 shard(s) it targeted is not done" in text and "--forcerun state/shard_2/status.json" in text


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "by_class, error, expected",
    [
        ({"template_error": 13}, "ShardFailed: every row of shard 0: 13 of 13 rows failed (template_error: 13)", "template_error"),
        (
            {"missing_variable": 3, "json_schema": 1},
            "ShardFailed: error budget exceeded in shard 0: 4 of 10 rows failed",
            "missing_variable, json_schema",
        ),
        ({"template_error": 3, "empty_output": 1}, "ShardFailed: error budget exceeded ... rows failed", None),  # empty_output: chance
        ({"template_error": 3}, "EngineFailed: engine 'llm' failed on row 4: ConnectError", None),  # not the rows' fault
        ({}, "OSError: no model at /x", None),
    ],
)
def test_repeats_identically_only_for_deterministic_row_errors(by_class, error, expected):
    assert terminal.repeats_identically({"rows_failed_by_class": by_class}, error) == expected


def _failed_shard(state: Path, shard: int, by_class: dict, error: str, signal=None) -> None:
    atomic_write_json(state / f"shard_{shard}/failure.json", {
        "shard_id": shard, "status": "failed", "attempt": 1, "error": error, "signal": signal,
        "traceback": "Traceback (most recent call last):\n  File x\nShardFailed: boom",
        "stats": {"rows_processed": 0, "rows_failed": sum(by_class.values()), "rows_failed_by_class": by_class},
    })  # fmt: skip


def test_failure_paragraph_says_a_deterministic_failure_repeats_and_never_shows_the_traceback(tmp_path):
    state = _state(tmp_path)
    _failed_shard(state, 0, {"template_error": 3}, "ShardFailed: every row of shard 0: 3 of 3 rows failed (template_error: 3); see x")
    (state / "shard_0/errors.jsonl").write_text(
        json.dumps({"dataset": 0, "source_index": 7, "stage": "render", "error": "template_error", "message": "outputs.a.prompt: UndefinedError: 'str object' has no attribute 'nope'"}) + "\n"
    )  # fmt: skip
    _failed_shard(state, 1, {"empty_output": 5}, "ShardFailed: every row of shard 1: 5 of 5 rows failed (empty_output: 5)")
    _failed_shard(state, 2, {}, "ShardInterrupted: interrupted by SIGINT; 3 rows committed, rerun to resume", signal="SIGINT")
    from mirageflow.state.shards import shard_states

    states = {s.shard_id: s for s in shard_states(state, 4, 300)}
    text = terminal.failure_paragraph(states[0], state, retry_hint="Rerun it with `mmirage retry --config p.yaml`.")
    assert text.startswith("shard 0 failed: every row of shard 0")
    assert "source index 7" in text and "no attribute 'nope'" in text and "fail the same way" in text
    assert "mmirage retry" not in text and "Traceback" not in text
    assert f"Log: {state / 'logs/shard_0.log'}" in text and str(state / "shard_0/errors.jsonl") in text
    text = terminal.failure_paragraph(states[1], state, retry_hint="Rerun it with `mmirage retry --config p.yaml`.")
    assert "mmirage retry --config p.yaml" in text and "same way" not in text
    text = terminal.failure_paragraph(states[2], state, retry_hint="Rerun it with `mmirage retry`.")
    assert "interrupted by SIGINT" in text and "resume" in text


def test_run_summary_counts_shards_and_rows_and_says_where_things_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = _state(tmp_path)
    atomic_write_json(state / "shard_0/status.json", _status(9, 1))
    atomic_write_json(state / "shard_1/status.json", _status(10, 0))
    (state / "shard_0/errors.jsonl").write_text('{"error": "json_parse"}\n')
    (state / "shard_1/errors.jsonl").write_text("")
    (state / "report.html").write_text("<html>")
    (tmp_path / "out/merged").mkdir(parents=True)
    pipeline = SimpleNamespace(
        state_dir="state", num_shards=2, n_samples=1, merge=True, shard=SimpleNamespace(lease_timeout_seconds=300),
        datasets=[SimpleNamespace(output_dir="out")],
    )  # fmt: skip
    text = terminal.run_summary(pipeline, ok=True, config_hint="p.yaml")
    assert text.startswith("mirageflow: run finished (state_dir state)")
    assert "shards: 2 of 2 done" in text and "rows: 19 ok, 1 failed (json_parse 1)" in text
    assert "merged output: out/merged/" in text and "report: state/report.html" in text
    assert "errors.jsonl (shards 0)" in text  # shard 1's errors.jsonl is empty
    assert "output tokens: 1,000" in text

    _failed_shard(state, 1, {"template_error": 4}, "ShardFailed: every row of shard 1: 4 of 4 rows failed (template_error: 4)")
    (state / "shard_1/status.json").unlink()
    text = terminal.run_summary(pipeline, ok=False, config_hint="p.yaml")
    assert text.startswith("mirageflow: run FAILED") and "shards: 1 of 2 done, 1 failed" in text
    assert "shard 1 failed: every row of shard 1" in text and "fail the same way" in text and "Traceback" not in text


def test_an_interrupted_run_says_so_what_each_stopped_shard_kept_and_the_command_to_continue(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = _state(tmp_path)
    atomic_write_json(state / "shard_0/status.json", _status(10))
    _failed_shard(state, 1, {}, "ShardInterrupted: interrupted by SIGTERM; 4 rows committed, rerun to resume", signal="SIGTERM")
    failure = json.loads((state / "shard_1/failure.json").read_text())
    atomic_write_json(state / "shard_1/failure.json", {**failure, "committed": "4 rows"})
    _failed_shard(state, 2, {"template_error": 4}, "ShardFailed: every row of shard 2: 4 of 4 rows failed (template_error: 4)")
    pipeline = SimpleNamespace(
        state_dir="state", num_shards=4, n_samples=1, merge=True, shard=SimpleNamespace(lease_timeout_seconds=300),
        datasets=[SimpleNamespace(output_dir="out")],
    )  # fmt: skip
    command = terminal.driver_command(["/x/site-packages/snakemake/__main__.py", "--cores", "1", "--configfile", "my pipeline.yaml"])
    assert command == "snakemake --cores 1 --configfile 'my pipeline.yaml'"
    text = terminal.run_summary(pipeline, ok=False, config_hint="p.yaml", interrupted=15, command=command)
    assert text.startswith("mirageflow: run interrupted by SIGTERM (state_dir state)")
    assert "shards: 1 of 4 done, 1 stopped, 1 failed, 1 not run" in text
    assert "  shard 1 stopped with 4 rows committed" in text and "shard 1 failed" not in text
    assert "shard 2 failed: every row of shard 2" in text  # a real failure is still one
    assert text.endswith(f"Run the same command to continue: {command}")
    assert "FAILED" not in text and "No shard failed" not in text


# --------------------------------------------------------------------------- through Snakemake


def _pipeline(model, prompt: str, rows: int = 6) -> dict:
    return pipeline_config(
        model=model, num_shards=2, loading={"batch_size": 4}, outputs=[{"name": "a", "prompt": prompt}],
        processor={"backend": "transformers", "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 4}},
        processing={"remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
    )  # fmt: skip


def _data(root: Path, rows: int = 6) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "in.jsonl").write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(rows)))


def test_snakemake_prints_progress_and_a_summary_at_the_end(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv(terminal.ENV_INTERVAL, "0.5")
    _data(tmp_path)
    proc = run_workflow(tmp_path, _pipeline(tiny_model, "Answer: {{ q }}"))
    err = proc.stderr
    assert "mirageflow: shards 0/2 done, 1 running" in err  # live progress while the first shard ran
    summary = err[err.index("mirageflow: run finished") :]
    assert "shards: 2 of 2 done" in summary and "rows: 6 ok, 0 failed" in summary
    assert "merged output: out/merged/" in summary and "report: state/report.html" in summary


def test_an_expected_failure_is_one_paragraph_not_a_traceback(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv(terminal.ENV_INTERVAL, "0")
    _data(tmp_path)
    proc = run_workflow(tmp_path, _pipeline(tiny_model, "Answer: {{ q.nope }}"), "--keep-going", check=False)
    assert proc.returncode != 0
    err = proc.stderr
    summary = err[err.index("mirageflow: run FAILED") :]
    assert "shards: 0 of 2 done, 2 failed" in summary and "rows: 0 ok, 6 failed (template_error 6)" in summary
    for shard in (0, 1):
        assert f"shard {shard} failed: every row of shard {shard}" in summary
        assert f"Log: state/logs/shard_{shard}.log" in summary
    assert summary.count("a retry would fail the same way") == 2 and "mmirage retry" not in summary
    assert "Traceback" not in err and "Traceback" in (tmp_path / "state/logs/shard_0.log").read_text()
    # nothing of this happens in a dry run
    proc = run_workflow(tmp_path, _pipeline(tiny_model, "Answer: {{ q.nope }}"), "--dry-run", check=False)
    assert "mirageflow: run" not in proc.stderr
