"""The canary (execution_params.canary_rows): shard 0's first rows run first, and no shard starts
unless their quality counters pass. The engine is the openai backend against the fake
OpenAI-compatible server (tests/fakes/fake_http.py, a thread of this process): an answer of
n words stops at the length limit when n >= max_new_tokens, so max_new_tokens 1 cuts them all."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from conftest import run_workflow, shard_jobs
from fakes.fake_http import FakeServer
from fakes.runs import mark_incomplete
from mirageflow.config import load_config
from mirageflow.errors import RowErrorClass as E
from mirageflow.shard import canary as C
from mirageflow.shard.runner import index_datasets
from mirageflow.state.layout import StateLayout
from mirageflow.state.shards import current_fingerprint

ROWS = 10
pytestmark = pytest.mark.usefixtures("no_proxy")


@pytest.fixture
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def pipeline(root: Path, server: FakeServer, max_new_tokens: int = 50, canary_rows: int | None = 3) -> dict:
    data = root / "in.jsonl"
    data.write_text("".join(json.dumps({"text": f"passage {i}"}) + "\n" for i in range(ROWS)))
    return {
        "processors": [{
            "type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "fake-model"},
            "default_sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}, "max_retries": 0,
            "request_timeout": 30,
        }],
        "loading_params": {
            "state_dir": str(root / "state"), "num_shards": 2,
            "datasets": [{"path": str(data), "type": "jsonl", "output_dir": str(root / "out"), "output_format": "jsonl"}],
        },
        "shard_params": {"max_error_rate": 1.0},
        "execution_params": {"canary_rows": canary_rows},
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [{"name": "summary", "prompt": "Summarise: {{ text }}"}],
            "output_schema": {"summary": "{{ summary }}"},
        },
    }  # fmt: skip


# --------------------------------------------------------------------------- the verdict


def _stats(answers=100, json_answers=100, cut=0, **by_class) -> dict:
    return {"answers": answers, "json_answers": json_answers, "answers_length_cut": cut, "rows_failed_by_class": by_class}


def test_healthy_counters_pass():
    verdict = C.judge(_stats(cut=5, json_parse=3, empty_output=2, json_truncated=2, reasoning_truncated=2))
    assert verdict["passed"] and verdict["problems"] == [], verdict


@pytest.mark.parametrize(
    "stats, counter, change",
    [
        (_stats(json_schema=6), "valid_json_rate", "output_schema"),
        (_stats(empty_output=3), "empty_output_rate", "allow_empty_output"),
        (_stats(json_truncated=3), "json_truncated_rate", "max_new_tokens"),
        (_stats(reasoning_truncated=3), "reasoning_truncated_rate", "chat_template_kwargs"),
        (_stats(cut=6), "length_cut_share", "max_new_tokens"),
    ],
)
def test_each_counter_over_its_threshold_fails_and_says_what_to_change(stats, counter, change):
    verdict = C.judge(stats)
    assert not verdict["passed"]
    assert [p.split(" ")[0] for p in verdict["problems"]] == [counter]
    assert change in verdict["problems"][0] and not verdict["counters"][counter]["ok"]


def test_no_json_output_has_no_json_rate():
    verdict = C.judge(_stats(json_answers=0))
    assert verdict["passed"] and verdict["counters"]["valid_json_rate"]["value"] is None
    assert E.JSON_TRUNCATED in C.JSON_FAILURES


def test_every_row_error_class_counts_not_only_the_answer_classes():
    """Item 16: 6 of 10 rows failed by template_error (no answer counter judges it) fail the canary."""
    stats = {**_stats(answers=4, json_answers=4), "rows_processed": 4, "rows_failed": 6, "rows_failed_by_class": {"template_error": 6}}
    verdict = C.judge(stats)
    assert not verdict["passed"] and [p.split(" ")[0] for p in verdict["problems"]] == ["other_row_errors_rate"]
    assert "60.0 % (at most 2 % to pass; template_error 6)" in verdict["problems"][0]
    # every class of RowErrorClass is judged by exactly one counter
    assert set(C.ANSWER_CLASSES) <= set(E) and not C.other_classes({"rows_failed_by_class": dict.fromkeys(C.ANSWER_CLASSES, 1)})


def test_a_canary_in_front_of_a_batch_api_output_is_refused_by_name(tmp_path):
    """Item 16: the canary's own batch would hold every shard up to 24 h: refused before any job."""
    from mirageflow.config import ConfigError

    raw = pipeline(tmp_path, FakeServer())
    raw["processors"] = [{"type": "batch_api", "provider": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "K"}]
    raw["processing_params"]["outputs"][0]["type"] = "batch_api"
    with pytest.raises(ConfigError, match=r"execution_params\.canary_rows: output\(s\) summary go to a batch_api processor.*24 h"):
        load_config(raw)
    raw["execution_params"]["canary_rows"] = None
    load_config(raw)


# --------------------------------------------------------------------------- the job, without Snakemake


def test_the_canary_runs_only_its_rows_in_its_own_state_dir(tmp_path, server):
    cfg = load_config(copy.deepcopy(pipeline(tmp_path, server, canary_rows=3)))
    index_datasets(cfg)
    paths = StateLayout(cfg.state_dir)
    verdict = C.run_canary(cfg, paths.canary_verdict)
    assert verdict["passed"] and verdict["rows_processed"] == 3 and verdict["canary_rows"] == 3
    assert len(server.records) == 3  # shard 0 has 5 rows; the canary sent 3
    assert json.loads(paths.canary_verdict.read_text())["passed"]
    assert not (tmp_path / "out").exists()  # the shards' records are untouched
    # shard 0's state holds only the canary's answers, handed over whole (no checkpoint, no status)
    assert sorted(p.name for p in paths.shard_dir(0).iterdir()) == ["request_cache"]
    assert verdict["answers_handed_to_shard_0"] == 3
    assert (StateLayout(paths.canary_state).status(0)).exists()


def test_the_canary_never_replaces_a_request_cache_shard_0_already_has(tmp_path, server):
    cfg = load_config(copy.deepcopy(pipeline(tmp_path, server, canary_rows=3)))
    index_datasets(cfg)
    paths = StateLayout(cfg.state_dir)
    own = paths.shard_dir(0) / "request_cache"
    own.mkdir(parents=True)
    (own / "manifest.json").write_text('{"format": 1, "segments": []}\n')
    verdict = C.run_canary(cfg, paths.canary_verdict)
    assert verdict["passed"] and verdict["answers_handed_to_shard_0"] == 0
    assert sorted(p.name for p in own.iterdir()) == ["manifest.json"]
    assert (own / "manifest.json").read_text() == '{"format": 1, "segments": []}\n'


def test_a_canary_cache_that_cannot_be_handed_over_leaves_shard_0_to_ask_again(tmp_path, server, caplog):
    cfg = load_config(copy.deepcopy(pipeline(tmp_path, server, canary_rows=3)))
    index_datasets(cfg)
    paths = StateLayout(cfg.state_dir)
    assert C.run_canary(cfg, paths.canary_verdict)["answers_handed_to_shard_0"] == 3
    shutil.rmtree(paths.shard_dir(0))
    canary_cache = StateLayout(paths.canary_state).shard_dir(0) / "request_cache"
    (canary_cache / "manifest.json").write_text('{"format": 1, "segments": [{"name": "seg-99999.jsonl"}]}\n')  # a lost segment
    assert C.seed_shard_cache(cfg, C.canary_config(cfg)) == 0
    assert not paths.shard_dir(0).exists() or not any(paths.shard_dir(0).iterdir())  # nothing half-copied left
    assert "seg-99999.jsonl" in caplog.text and "asks its rows again" in caplog.text


def test_a_failed_canary_writes_its_verdict_elsewhere_and_a_retry_does_not_rerun_it(tmp_path, server):
    cfg = load_config(copy.deepcopy(pipeline(tmp_path, server, max_new_tokens=1)))
    index_datasets(cfg)
    paths = StateLayout(cfg.state_dir)
    with pytest.raises(C.CanaryFailed, match=r"length_cut_share is 100\.0 % \(at most 5 %.*max_new_tokens"):
        C.run_canary(cfg, paths.canary_verdict)
    assert not paths.canary_verdict.exists() and json.loads(paths.canary_failed.read_text())["passed"] is False
    sent = len(server.records)
    with pytest.raises(C.CanaryFailed, match="not run again"):
        C.run_canary(cfg, paths.canary_verdict, attempt=2)
    assert len(server.records) == sent


def test_a_canary_whose_rows_fail_by_a_template_error_fails_under_any_max_error_rate(tmp_path, server):
    """Item 16, end to end: max_error_rate 1.0 lets the canary shard finish; 2 of its 3 rows
    fail by template_error (a division by zero on even rows), and the verdict says so."""
    raw = pipeline(tmp_path, server, canary_rows=3)
    raw["processing_params"]["outputs"][0]["prompt"] = "Summarise: {{ text }} {{ 1 // (text[-1] | int % 2) }}"
    cfg = load_config(copy.deepcopy(raw))
    index_datasets(cfg)
    paths = StateLayout(cfg.state_dir)
    with pytest.raises(C.CanaryFailed, match=r"other_row_errors_rate is 66\.7 % \(at most 2 % to pass; template_error 2\)"):
        C.run_canary(cfg, paths.canary_verdict)
    assert not paths.canary_verdict.exists()


# --------------------------------------------------------------------------- end to end, local profile


def test_a_passing_canary_lets_the_shards_run(tmp_path, server):
    proc = run_workflow(tmp_path, pipeline(tmp_path, server))
    paths = StateLayout(tmp_path / "state")
    assert json.loads(paths.canary_verdict.read_text())["passed"]
    assert paths.status(0).exists() and paths.status(1).exists()
    # the canary's 3, then every row but those 3: shard 0 has the canary's answers
    assert len(server.records) == ROWS
    assert json.loads(paths.status(0).read_text())["stats"]["requests_cached"] == 3
    merged = [json.loads(line) for p in sorted((tmp_path / "out" / "merged").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert [r["source_index"] for r in merged] == list(range(ROWS)) and all(r["summary"] for r in merged)
    log = proc.stderr
    assert log.index("rule canary") < log.index("rule shard")
    again = run_workflow(tmp_path, pipeline(tmp_path, server))  # nothing to do: the verdict holds
    assert "rule canary" not in again.stderr and len(server.records) == ROWS


def test_a_failing_canary_stops_before_any_shard_with_its_message(tmp_path, server):
    proc = run_workflow(tmp_path, pipeline(tmp_path, server, max_new_tokens=1), check=False)
    assert proc.returncode != 0
    paths = StateLayout(tmp_path / "state")
    assert not paths.shard_dir(0).exists() and not paths.shard_dir(1).exists()  # no shard started
    assert len(server.records) == 3
    log = paths.log("canary").read_text()
    assert "the canary (3 rows of shard 0) failed, no shard was started: length_cut_share is 100.0 %" in log
    assert "sampling_params.max_new_tokens" in log
    assert "length_cut_share" in proc.stderr  # the run's summary names it too


def _records_fingerprints(root: Path, n: int = 2) -> list:
    paths = StateLayout(root / "state")
    return [json.loads(paths.status(i).read_text())["records_fingerprint"] for i in range(n)]


def _merged(root: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((root / "out" / "merged").glob("*.jsonl")) for line in p.read_text().splitlines()]


def test_after_each_prompt_edit_the_canary_runs_first_and_then_every_shard(tmp_path, server):
    """Item 8: an edit, its undo and a run with no change. Each edit runs the canary, then
    every shard, in that one run; the run after it has nothing to do."""
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg)
    verdict_path = StateLayout(tmp_path / "state").canary_verdict
    for prompt in ("Summarise briefly: {{ text }}", "Summarise: {{ text }}"):  # the edit, then its undo
        cfg["processing_params"]["outputs"][0]["prompt"] = prompt
        proc = run_workflow(tmp_path, cfg)
        now = current_fingerprint(load_config(copy.deepcopy(cfg)))
        assert proc.stderr.count("rule canary:") == 1 and shard_jobs(proc) == 2, proc.stderr[-3000:]
        assert proc.stderr.index("rule canary:") < proc.stderr.index("rule shard:")
        assert json.loads(verdict_path.read_text())["records_fingerprint"] == now
        assert _records_fingerprints(tmp_path) == [now, now]  # no shard left with the other prompt's records
        assert [r["source_index"] for r in _merged(tmp_path)] == list(range(ROWS))
        again = run_workflow(tmp_path, cfg)
        assert "rule canary:" not in again.stderr and shard_jobs(again) == 0, again.stderr[-3000:]


def test_a_kill_after_the_canary_s_verdict_then_the_documented_recovery_finishes_every_shard(tmp_path, server):
    """Item 9: the canary job writes its verdict while the driver cannot register it (stopped,
    then killed with its jobs); `--unlock`, then the same command must run every shard in that
    one rerun (the passed verdict kept, marked incomplete or not), and merge."""
    cfg = pipeline(tmp_path, server)
    paths = StateLayout(tmp_path / "state")
    server.behaviour.latency = 0.3  # the canary's rows take long enough to stop the driver inside
    with open(tmp_path / "driver.log", "w") as out:
        proc = run_workflow(tmp_path, cfg, background=True, stdout=out)
        deadline = time.monotonic() + 120
        while not server.records and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.records and proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGSTOP)  # the driver: its canary job goes on and writes the verdict
        while "canary passed" not in (paths.log("canary").read_text() if paths.log("canary").exists() else ""):
            assert time.monotonic() < deadline, paths.log("canary").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    server.behaviour.latency = 0.0
    assert paths.canary_verdict.exists() and not paths.status(0).exists()
    run_workflow(tmp_path, cfg, "--unlock")
    proc = run_workflow(tmp_path, cfg)  # the same command: the verdict, a pass of this config, is kept
    assert shard_jobs(proc) == 2, proc.stderr[-3000:]
    assert paths.status(0).exists() and paths.status(1).exists()
    assert [r["source_index"] for r in _merged(tmp_path)] == list(range(ROWS))
    assert "not run" not in proc.stderr


def test_a_passed_verdict_left_marked_incomplete_is_kept_by_the_same_command(tmp_path, server):
    """A driver stopped while the canary wrote its verdict leaves Snakemake's incomplete mark on
    it: the same command keeps a verdict that passed for this config (no canary again, no
    --rerun-incomplete) and runs only the shard left."""
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg)
    paths = StateLayout(tmp_path / "state")
    paths.status(1).unlink()  # a shard left to run
    mtime = paths.canary_verdict.stat().st_mtime_ns
    mark_incomplete(tmp_path, str(paths.canary_verdict))

    dry = run_workflow(tmp_path, cfg, "-n")  # a dry run says what the real one does
    assert "IncompleteFilesException" not in dry.text and "rule canary:" not in dry.text, dry.text[-3000:]
    proc = run_workflow(tmp_path, cfg)
    assert "rule canary:" not in proc.text and shard_jobs(proc) == 1 and "wildcards: shard=1" in proc.text, proc.text[-3000:]
    assert paths.canary_verdict.stat().st_mtime_ns == mtime
    assert [r["source_index"] for r in _merged(tmp_path)] == list(range(ROWS))


def test_a_failed_verdict_left_marked_incomplete_is_made_again_by_the_same_command(tmp_path, server):
    """A verdict of another canary_rows (not this config's pass) marked incomplete: made again,
    and the shards after it."""
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg)
    paths = StateLayout(tmp_path / "state")
    cfg["execution_params"]["canary_rows"] = 2
    mark_incomplete(tmp_path, str(paths.canary_verdict))
    proc = run_workflow(tmp_path, cfg)
    assert proc.text.count("rule canary:") == 1 and shard_jobs(proc) == 2, proc.text[-3000:]
    assert json.loads(paths.canary_verdict.read_text())["canary_rows"] == 2


def test_without_canary_rows_there_is_no_canary(tmp_path, server):
    proc = run_workflow(tmp_path, pipeline(tmp_path, server, canary_rows=None), "--dry-run")
    assert "rule canary" not in proc.stdout + proc.stderr


def test_docs_and_schema_state_the_thresholds():
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "docs" / "canary.md").read_text()
    schema = (repo / "workflow" / "schemas" / "config.schema.yaml").read_text()
    names = [n for n in vars(C) if n.startswith("CANARY_")]
    assert len(names) == len(C.COUNTERS)
    for name in names:
        assert f"`{name}` = {getattr(C, name):.2f}" in readme, name
    for c in C.COUNTERS:
        assert f"{'<=' if c.at_most else '>='} {100 * c.threshold:.0f} %" in schema, c.name
