"""Reruns follow edits, and nothing stale or foreign passes for current: real `snakemake` runs.

The engine is the `openai` backend against the fake OpenAI-compatible server in
tests/fakes/fake_http.py (a thread of this process), so a whole run takes seconds. A prompt
holding "TOO_LONG" gets a context-length error: that row fails.

Both rerun-trigger settings are exercised: Snakemake's defaults and `--rerun-triggers mtime`
(profiles/slurm), where mtimes alone cannot tell a shard that its config changed (the
driver forces it: mirageflow/state/inputs.py).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_workflow, shard_jobs
from fakes.configs import pipeline_config
from fakes.runs import files_on_disk, merged_rows
from fakes.fake_http import FakeServer

from mirageflow import cli
from mirageflow.state import pipeline as pipeline_state
from mirageflow.config import load_config, records_identity

pytestmark = pytest.mark.usefixtures("no_proxy")

TRIGGERS = {"default": (), "mtime": ("--rerun-triggers", "mtime")}
ROWS = 8  # 2 shards of 4; rows 0 and 1 (shard 0) carry the TOO_LONG marker in `flag`


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def write_rows(path: Path) -> Path:
    if path.exists():  # rewriting it would make the dataset's index stale
        return path
    rows = [{"text": f"passage {i}", "flag": "TOO_LONG" if i < 2 else "fine"} for i in range(ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pipeline(root: Path, server: FakeServer, state: str = "state", out: str = "out") -> dict:
    write_rows(root / "in.jsonl")
    return pipeline_config(
        inputs=["text", "flag"], outputs=[{"name": "answer", "prompt": "Summarise: {{ text }}"}], model="fake-model",
        state_dir=state, output_dir=out, num_shards=2, dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": server.url + "/v1", "default_sampling_params": {"max_new_tokens": 5},
                   "max_retries": 0, "request_timeout": 30},
    )  # fmt: skip


def mtimes(root: Path, state: str = "state") -> dict:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in sorted((root / state).glob("shard_*/status.json"))}


# --------------------------------------------------------------------------- what the fingerprint covers (no Snakemake)


def _edits() -> dict:
    def prompt(c):
        c["processing_params"]["outputs"][0]["prompt"] = "Condense: {{ text }}"

    def system(c):
        c["processing_params"]["outputs"][0]["system"] = "Be brief."

    def inputs(c):
        c["processing_params"]["inputs"][0]["key"] = "flag"

    def output_schema(c):
        c["processing_params"]["output_schema"] = {"a": "{{ answer }}"}

    def output_type(c):
        c["processing_params"]["outputs"][0].update(output_type="JSON", output_schema={"summary": "str"})

    def remove_columns(c):
        c["processing_params"]["remove_columns"] = True

    def model(c):
        c["processors"][0]["server_args"]["model_path"] = "other-model"

    def served_model(c):
        c["processors"][0]["model"] = "served-name"

    def sampling(c):
        c["processors"][0]["default_sampling_params"]["max_new_tokens"] = 6

    def temperature(c):
        c["processors"][0]["default_sampling_params"]["temperature"] = 0.3

    def output_sampling(c):
        c["processing_params"]["outputs"][0]["sampling_params"] = {"top_p": 0.5}

    def chat_kwargs(c):
        c["processors"][0]["chat_template_kwargs"] = {"enable_thinking": False}

    def dataset_path(c):
        c["loading_params"]["datasets"][0]["path"] = "other.jsonl"

    def output_dir(c):
        c["loading_params"]["datasets"][0]["output_dir"] = "out2"

    def output_format(c):
        c["loading_params"]["datasets"][0]["output_format"] = "parquet"

    return {f.__name__: f for f in (prompt, system, inputs, output_schema, output_type, remove_columns, model, served_model,
                                    sampling, temperature, output_sampling, chat_kwargs, dataset_path, output_dir, output_format)}  # fmt: skip


def _cosmetic() -> dict:
    def execution_params(c):
        c["execution_params"] = {"account": "a1", "time_limit": "01:00:00", "mem": "8G", "merge": True}

    def shard_params(c):
        c["shard_params"] = {"checkpoint_rows": 3, "max_error_rate": 0.5, "max_inflight": 4}

    def stats(c):
        c["stats"] = True

    def retry_failed_rows(c):
        c["retry_failed_rows"] = True

    def timeouts(c):
        c["processors"][0].update(request_timeout=99, max_retries=2, base_url="http://elsewhere:1/v1")

    def mmirage_keys(c):
        c["loading_params"]["shard_id"] = "$SLURM_ARRAY_TASK_ID"

    return {f.__name__: f for f in (execution_params, shard_params, stats, retry_failed_rows, timeouts, mmirage_keys)}


@pytest.fixture
def base_cfg(tmp_path) -> dict:
    write_rows(tmp_path / "other.jsonl")
    data = write_rows(tmp_path / "in.jsonl")
    return pipeline_config(
        data, inputs=["text", "flag"], outputs=[{"name": "answer", "prompt": "Summarise: {{ text }}"}], model="fake-model",
        state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=2, dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": "http://h:1/v1", "default_sampling_params": {"max_new_tokens": 5}},
    )  # fmt: skip


def _fingerprint(raw: dict, cwd: Path) -> str:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return pipeline_state.records_fingerprint(load_config(raw, environ={}))["sha256"]
    finally:
        os.chdir(old)


@pytest.mark.parametrize("edit", sorted(_edits()))
def test_edits_that_change_records_change_the_fingerprint(base_cfg, tmp_path, edit):
    edited = copy.deepcopy(base_cfg)
    _edits()[edit](edited)
    if edit == "dataset_path":
        edited["loading_params"]["datasets"][0]["path"] = str(tmp_path / "other.jsonl")
    assert _fingerprint(edited, tmp_path) != _fingerprint(base_cfg, tmp_path)


@pytest.mark.parametrize("edit", sorted(_cosmetic()))
def test_edits_that_cannot_change_records_keep_the_fingerprint(base_cfg, tmp_path, edit):
    edited = copy.deepcopy(base_cfg)
    _cosmetic()[edit](edited)
    assert _fingerprint(edited, tmp_path) == _fingerprint(base_cfg, tmp_path)


def test_records_identity_is_what_the_docs_say(base_cfg, tmp_path):
    ident = records_identity(load_config(base_cfg, environ={}))
    assert set(ident) == {"version", "processors", "processing_params", "datasets"}
    assert set(ident["datasets"][0]) == {"path", "type", "split", "output_format", "output_dir"}
    assert "request_timeout" not in ident["processors"][0] and ident["processors"][0]["default_sampling_params"] == {"max_new_tokens": 5}


def test_fingerprint_file_is_rewritten_only_when_it_changes(base_cfg, tmp_path):
    cfg = load_config(base_cfg, environ={})
    assert pipeline_state.write_records_fingerprint(cfg) is True
    path = tmp_path / "state" / "records.fingerprint"
    stamp = path.stat().st_mtime_ns
    assert json.loads(path.read_text())["identity"]["processing_params"]["outputs"][0]["prompt"] == "Summarise: {{ text }}"
    time.sleep(0.01)
    assert pipeline_state.write_records_fingerprint(load_config(copy.deepcopy(base_cfg) | {"stats": True}, environ={})) is False
    assert path.stat().st_mtime_ns == stamp
    edited = copy.deepcopy(base_cfg)
    _edits()["prompt"](edited)
    assert pipeline_state.write_records_fingerprint(load_config(edited, environ={})) is True
    assert path.stat().st_mtime_ns > stamp


def test_a_rerun_names_the_keys_that_changed(base_cfg, tmp_path):
    """The driver's reason to rerun a shard names the key paths that changed since its
    status.json, not the list of what could have."""
    cfg = load_config(base_cfg, environ={})
    pipeline_state.write_records_fingerprint(cfg)
    recorded = pipeline_state.records_fingerprint(cfg)["sha256"]
    edited = copy.deepcopy(base_cfg)
    _edits()["prompt"](edited)
    edited["processors"][0]["default_sampling_params"]["max_new_tokens"] = 7
    changed = pipeline_state.records_changes(load_config(edited, environ={}), recorded)
    assert changed == ["processors[0].default_sampling_params.max_new_tokens", "processing_params.outputs[0].prompt"]
    assert pipeline_state.records_changes(load_config(edited, environ={}), "another run's fingerprint") is None


# --------------------------------------------------------------------------- reruns follow edits, through Snakemake


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_reruns_follow_edits(tmp_path, server, trigger):
    flags = TRIGGERS[trigger]
    cfg = pipeline(tmp_path, server)
    first = run_workflow(tmp_path, cfg, *flags)
    assert shard_jobs(first) == 2
    done = mtimes(tmp_path)
    before = merged_rows(tmp_path)
    assert [r["source_index"] for r in before] == list(range(ROWS))

    # Edits that cannot change a record: nothing reruns (a comment, execution_params,
    # shard_params, stats, how the engine is reached).
    cosmetic = copy.deepcopy(cfg)
    for edit in _cosmetic().values():
        edit(cosmetic)
    cosmetic["processors"][0]["base_url"] = cfg["processors"][0]["base_url"]  # the server that answers
    proc = run_workflow(tmp_path, "# a comment\n" + yaml.safe_dump(cosmetic, sort_keys=False), *flags)
    assert "Nothing to be done" in proc.text and shard_jobs(proc) == 0, proc.text[-3000:]
    assert mtimes(tmp_path) == done

    # Edits that can: every shard is scheduled again (dry runs), then for real.
    for name in ("sampling", "output_schema", "model"):
        edited = copy.deepcopy(cfg)
        _edits()[name](edited)
        before_dry_run = files_on_disk(tmp_path)
        proc = run_workflow(tmp_path, edited, "-n", *flags)
        assert shard_jobs(proc) == 2, (name, proc.text[-3000:])
        assert files_on_disk(tmp_path) == before_dry_run  # issue 22, item 15: a dry run writes nothing

    edited = copy.deepcopy(cfg)
    _edits()["prompt"](edited)
    proc = run_workflow(tmp_path, edited, *flags)
    assert shard_jobs(proc) == 2 and "Nothing to be done" not in proc.text
    assert "is made again: what can change its records changed: processing_params.outputs[0].prompt" in proc.text
    assert all(mtimes(tmp_path)[k] > done[k] for k in done)
    prompts = [r["body"]["messages"][-1]["content"] for r in server.records[-ROWS:]]
    assert sorted(prompts) == sorted(f"Condense: passage {i}" for i in range(ROWS))
    assert len(merged_rows(tmp_path)) == ROWS
    proc = run_workflow(tmp_path, edited, *flags)
    assert "Nothing to be done" in proc.text


# --------------------------------------------------------------------------- an output_dir belongs to one pipeline


def test_second_pipeline_on_the_same_output_dir_is_refused(tmp_path, server):
    a = pipeline(tmp_path, server, state="state_a", out="shared_out")
    run_workflow(tmp_path, a)
    rows = merged_rows(tmp_path, "shared_out")
    files = {p: p.read_bytes() for p in (tmp_path / "shared_out").rglob("*") if p.is_file()}
    owner = json.loads((tmp_path / "shared_out" / ".mirageflow-owner.json").read_text())
    assert owner["state_dir"] == str(tmp_path / "state_a")

    b = pipeline(tmp_path, server, state="state_b", out="shared_out")
    b["processing_params"]["outputs"][0]["prompt"] = "Other: {{ text }}"
    for extra in (("-n",), ()):
        proc = run_workflow(tmp_path, b, *extra, check=False)
        assert proc.returncode != 0 and shard_jobs(proc) == 0
        assert "loading_params.datasets[0].output_dir: 'shared_out' belongs to another pipeline" in proc.text
        assert str(tmp_path / "state_a") in proc.text and str(tmp_path / "state_b") in proc.text
    assert not (tmp_path / "state_b").exists()
    assert {p: p.read_bytes() for p in (tmp_path / "shared_out").rglob("*") if p.is_file()} == files
    assert merged_rows(tmp_path, "shared_out") == rows

    # the owner, edited, goes on as before
    a["processing_params"]["outputs"][0]["prompt"] = "Condense: {{ text }}"
    proc = run_workflow(tmp_path, a)
    assert shard_jobs(proc) == 2
    assert "Nothing to be done" in run_workflow(tmp_path, a).text


def test_a_state_dir_of_another_pipeline_is_refused_naming_both_and_stats_refuse_it_too(tmp_path, server, capsys):
    """Item 15: pipeline b (its own data and output_dir) pointed at pipeline a's state_dir is
    refused before any job, naming a's config; a's shards are untouched and `mmirage stats` of b
    does not count them."""
    configs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        data = tmp_path / name / "in.jsonl"
        data.write_text("".join(json.dumps({"q": f"{name} {i}"}) + "\n" for i in range(4)))
        configs[name] = pipeline_config(
            data, state_dir=tmp_path / "state", output_dir=tmp_path / name / "out", num_shards=2,
            processor={"backend": "openai", "base_url": server.url + "/v1", "max_retries": 0}, shard_params={"max_error_rate": 1.0},
        )  # fmt: skip
    run_workflow(tmp_path / "a", configs["a"])
    status = tmp_path / "state" / "shard_0" / "status.json"
    before = status.stat().st_mtime_ns
    sent = len(server.records)
    for args in (["-n"], []):
        proc = run_workflow(tmp_path / "b", configs["b"], *args, check=False)
        assert proc.returncode != 0, proc.text[-3000:]
        assert "loading_params.state_dir: " in proc.text and "belongs to another pipeline" in proc.text, proc.text[-3000:]
        assert str(tmp_path / "a" / "pipeline.yaml") in proc.text and str(tmp_path / "b" / "out") in proc.text
    assert status.stat().st_mtime_ns == before and len(server.records) == sent
    assert not (tmp_path / "b" / "out").exists()
    assert cli.main(["stats", "--config", str(tmp_path / "b" / "pipeline.yaml")]) == cli.EXIT_USAGE
    assert "belongs to another pipeline" in capsys.readouterr().err
    assert run_workflow(tmp_path / "a", configs["a"]).returncode == 0  # its owner runs on


# --------------------------------------------------------------------------- never a stale success


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_failed_shard_is_rerun_and_nothing_stale_remains(tmp_path, server, trigger):
    """The reported case: after a run, edit the prompt and force the shards; shard 0 fails its
    error budget. A plain rerun and `mmirage retry` must retry it (not "Nothing to be
    done"), and the metrics and merged output of the previous prompt stay readable meanwhile,
    marked as the previous run's, never as current."""
    flags = TRIGGERS[trigger]
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg, *flags)
    state, out = tmp_path / "state", tmp_path / "out"
    derived = [state / "metrics.json", state / "summary.md", state / "report.html", state / "merged" / "dataset_0.json", out / "merged"]
    assert all(p.exists() for p in derived)

    failing = copy.deepcopy(cfg)
    failing["processing_params"]["outputs"][0]["prompt"] = "Summarise: {{ text }} {{ flag }}"  # rows 0-1: TOO_LONG
    failing["shard_params"] = {"max_error_rate": 0}
    proc = run_workflow(tmp_path, failing, "--forcerun", "shard", *flags, check=False)
    assert proc.returncode != 0 and "Error in rule shard" in proc.text
    assert not (state / "shard_0" / "status.json").exists()
    assert json.loads((state / "shard_0" / "failure.json").read_text())["status"] == "failed"
    assert_previous_run(tmp_path, derived)
    assert len(merged_rows(tmp_path)) == ROWS  # the last good result, still readable

    proc = run_workflow(tmp_path, failing, *flags, check=False)
    assert "Nothing to be done" not in proc.text and proc.returncode != 0
    assert "rule shard:" in proc.text and "wildcards: shard=0" in proc.text

    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(failing, sort_keys=False))
    retry = subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", "retry", "--config", "pipeline.yaml", "--", *flags],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "MIRAGEFLOW_WORKFLOW_DIR": str(REPO)},
    )  # fmt: skip
    assert "Nothing to be done" not in retry.stdout + retry.stderr and retry.returncode == 1
    assert_previous_run(tmp_path, derived)

    # each attempt of shard 0 kept its log (Snakemake deleted the rule's log before each rerun)
    attempts = sorted((state / "logs" / "attempts").glob("shard_0.*.log"))
    assert len(attempts) == 4, attempts  # the first run, the forced one, the rerun, the retry
    assert sum("max_error_rate" in a.read_text() or "error" in a.read_text().lower() for a in attempts[1:]) == 3

    # fixed: the next run completes and everything derived is rebuilt from the current shards
    fixed = copy.deepcopy(failing)
    fixed["shard_params"] = {"max_error_rate": 0.5}
    proc = run_workflow(tmp_path, fixed, *flags)
    assert all(p.exists() for p in derived)
    assert not (state / "previous_results.json").exists() and "previous run" not in (state / "report.html").read_text()
    metrics = json.loads((state / "metrics.json").read_text())["aggregate"]
    assert metrics["completed_shards"] == 2 and metrics["total_rows_failed"] == 2
    assert sorted(r["source_index"] for r in merged_rows(tmp_path)) == list(range(2, ROWS))


def assert_previous_run(root: Path, derived: list[Path]) -> None:
    """The derived outputs are there, each marked as the previous run's (state/pipeline.py)."""
    state = root / "state"
    assert all(p.exists() for p in derived), [p for p in derived if not p.exists()]
    marked = json.loads((state / "previous_results.json").read_text())
    assert {(root / p).resolve() for p in marked["outputs"]} >= {p.resolve() for p in derived}
    assert "The results of a previous run" in (state / "report.html").read_text()
    assert (state / "summary.md").read_text().startswith("> **The results of a previous run**")
    assert json.loads((state / "metrics.json").read_text())["previous_run"]["why"] == marked["why"]


def test_driver_drops_results_that_outlived_a_shard(tmp_path, server):
    """A shard whose status.json vanished without its job cleaning up (killed before it
    started, deleted by hand): the next run rebuilds it and the results depending on it."""
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg)
    (tmp_path / "state" / "shard_1" / "status.json").unlink()
    proc = run_workflow(tmp_path, cfg)
    assert "Nothing to be done" not in proc.text and "wildcards: shard=1" in proc.text
    assert (tmp_path / "state" / "metrics.json").exists() and len(merged_rows(tmp_path)) == ROWS


def test_no_exit_0_while_a_targeted_shard_is_not_done(tmp_path, server):
    """Snakemake takes a shard's status.json for complete when nothing tells it otherwise (here
    a damaged one: newer than its inputs, no content change to force it). Asked
    for both shards (`mmirage run --shard-ids 0 1`), it runs shard 0 alone and, on its own,
    exits 0 with shard 1 not done. The run must say so and exit non-zero; a target list
    without that shard is a success, and a dry run writes and says nothing of it."""
    cfg = pipeline(tmp_path, server)
    run_workflow(tmp_path, cfg)
    targets = [f"state/shard_{i}/status.json" for i in (0, 1)]  # as the state_dir is named (relative)
    status = tmp_path / targets[1]
    text = status.read_text()
    status.write_text(text[: len(text) // 2])  # cut short (a full disk, a copy interrupted)
    (tmp_path / targets[0]).unlink()  # a shard left to run

    dry = run_workflow(tmp_path, cfg, *targets, "-n")
    assert shard_jobs(dry) == 1 and "run NOT complete" not in dry.text, dry.text[-3000:]
    proc = run_workflow(tmp_path, cfg, *targets, check=False)
    assert shard_jobs(proc) == 1 and proc.returncode == 1, proc.text[-3000:]  # 1: shard 1 counts as failed
    assert "mirageflow: run NOT complete: 1 of the 2 shard(s) it targeted is not done" in proc.text, proc.text[-3000:]
    named = proc.text.split("run NOT complete")[1]
    assert "(shard 1 failed: damaged state file state/shard_1/status.json" in named, named[:500]
    assert f"Continue with: mmirage retry --config {tmp_path / 'pipeline.yaml'}" in named, named[:500]
    assert not list((tmp_path / ".snakemake" / "locks").glob("*")), "the failed run left its lock"

    (tmp_path / targets[0]).unlink()
    only_0 = run_workflow(tmp_path, cfg, targets[0])  # shard 1 is not its target: a success
    assert shard_jobs(only_0) == 1 and "run NOT complete" not in only_0.text
