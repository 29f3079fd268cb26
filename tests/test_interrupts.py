"""Stop and go: a signal to the driver (alone or with its group) stops the running shard, the
summary says "interrupted", and the very same command finishes the work. Real `snakemake` runs.

The engine is the `openai` backend against the fake OpenAI-compatible server of
tests/fakes/fake_http.py (a thread of this process) answering one request at a time after
a latency, so a shard is mid-way for many seconds: long enough to be stopped there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import FAKES, run_workflow, shard_jobs
from fakes.configs import pipeline_config, shard_config
from fakes.engines import ScriptedEngine
from fakes.fake_http import Behaviour, FakeServer
from fakes.runs import mark_incomplete, merged_rows

from mirageflow.config import load_config
from mirageflow.shard.runner import index_datasets, run_shard

pytestmark = pytest.mark.usefixtures("no_proxy")

ROWS = 16  # 2 shards of 8
LATENCY = 1.5  # seconds per answer: a shard takes 12 s of answers at least


@pytest.fixture(scope="module")
def server():
    s = FakeServer(Behaviour(latency=LATENCY)).start()
    yield s
    s.stop()


def pipeline(root: Path, server: FakeServer) -> dict:
    data = root / "in.jsonl"
    data.write_text("".join(json.dumps({"text": f"passage {i}"}) + "\n" for i in range(ROWS)))
    return pipeline_config(
        inputs=["text"], outputs=[{"name": "answer", "prompt": "Summarise: {{ text }}"}], model="fake-model",
        num_shards=2, dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": server.url + "/v1", "default_sampling_params": {"max_new_tokens": 5},
                   "max_retries": 0, "request_timeout": 60},
        shard_params={"max_inflight": 1, "checkpoint_rows": 1, "checkpoint_min_seconds": 0},
    )  # fmt: skip


def committed_rows(root: Path, shard: int) -> int:
    try:
        manifest = json.loads((root / f"state/shard_{shard}/checkpoint.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(b - a for ds in manifest["datasets"].values() for part in ds["parts"] for a, b in part["rows"])


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"never {what}")


def stop(proc: subprocess.Popen, signum: int, target: str) -> str:
    """Send ``signum`` to the driver alone or to its process group; the driver's whole output."""
    if target == "group":  # a terminal's Ctrl-C
        os.killpg(proc.pid, signum)
    else:  # a script, a supervisor, tmux: the driver's pid only
        os.kill(proc.pid, signum)
    try:
        # far less than the 12 s of answers a shard has left: the shard stopped, it did not finish
        return proc.communicate(timeout=40)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the driver did not stop after {signal.Signals(signum).name} to the {target}:\n{proc.communicate()[0][-4000:]}")


@pytest.mark.parametrize(
    "signum,target",
    [(signal.SIGINT, "driver"), (signal.SIGTERM, "driver"), (signal.SIGINT, "group"), (signal.SIGTERM, "group")],
    ids=["sigint-driver", "sigterm-driver", "sigint-group", "sigterm-group"],
)
def test_a_signal_stops_the_running_shard_and_the_same_command_finishes_the_work(tmp_path, server, signum, target):
    cfg = pipeline(tmp_path, server)
    proc = run_workflow(tmp_path, cfg, background=True)
    wait_for(lambda: committed_rows(tmp_path, 0) >= 2, proc, "shard 0 committed rows")
    out = stop(proc, signum, target)
    name = signal.Signals(signum).name

    assert proc.returncode != 0, out[-3000:]
    failure = json.loads((tmp_path / "state/shard_0/failure.json").read_text())
    assert failure["signal"] == name, failure
    kept = committed_rows(tmp_path, 0)
    assert 2 <= kept < ROWS // 2, out[-3000:]  # stopped mid-way, what was finished committed
    assert not (tmp_path / "state/shard_0/status.json").exists()
    # the summary: interrupted, not failed; what is committed; the command that continues
    assert f"mirageflow: run interrupted by {name}" in out, out[-3000:]
    assert "run FAILED" not in out and "No shard failed" not in out, out[-3000:]
    assert f"shard 0 stopped with {kept} rows committed" in out, out[-3000:]
    assert "Run the same command to continue:" in out and "--configfile" in out.split("Run the same command to continue:")[1]
    # no Snakemake traceback or error block for an interrupt
    for noise in ("RuleException", "CalledProcessError", "Traceback", "Error in rule shard", "did not complete successfully"):
        assert noise not in out, (noise, out[-3000:])

    # the very same command: no --unlock, no --rerun-incomplete; it runs the stopped shard and
    # any that had not started (Snakemake's order of the two shards is its own)
    not_done = sum(not (tmp_path / f"state/shard_{i}/status.json").exists() for i in range(2))
    proc = run_workflow(tmp_path, cfg)
    assert shard_jobs(proc) == not_done, proc.text[-3000:]
    log = (tmp_path / "state/logs/shard_0.log").read_text()
    assert f"resuming shard 0: {kept} rows already committed are skipped" in log
    assert [r["source_index"] for r in merged_rows(tmp_path)] == list(range(ROWS))  # every row exactly once
    assert "Nothing to be done" in run_workflow(tmp_path, cfg).text


def test_a_finished_shard_left_marked_incomplete_is_done_for_the_same_command(tmp_path, server):
    """The reported history: the driver was stopped while a shard wrote its status.json, so
    Snakemake never saw the job end. The same command keeps the shard (a verified success) and
    runs the rest, where Snakemake alone refused (IncompleteFilesException)."""
    cfg = pipeline(tmp_path, server)
    proc = run_workflow(tmp_path, cfg, background=True)

    def one_done_and_the_other_started() -> bool:  # Snakemake's order of the two shards is its own
        done = [(tmp_path / f"state/shard_{i}/status.json").exists() for i in (0, 1)]
        return any(done[i] and committed_rows(tmp_path, 1 - i) >= 1 for i in (0, 1))

    wait_for(one_done_and_the_other_started, proc, "one shard finished and the other committed a row")
    stop(proc, signal.SIGINT, "driver")
    finished = 0 if (tmp_path / "state/shard_0/status.json").exists() else 1
    status = tmp_path / f"state/shard_{finished}/status.json"
    assert json.loads(status.read_text())["status"] == "success"
    mtime = status.stat().st_mtime_ns
    mark_incomplete(tmp_path, f"state/shard_{finished}/status.json")

    proc = run_workflow(tmp_path, cfg, "-n")  # a dry run says what the real one does
    assert shard_jobs(proc) == 1 and "IncompleteFilesException" not in proc.text
    proc = run_workflow(tmp_path, cfg)
    assert shard_jobs(proc) == 1 and f"wildcards: shard={1 - finished}" in proc.text
    assert status.stat().st_mtime_ns == mtime  # the finished shard was not run again
    assert [r["source_index"] for r in merged_rows(tmp_path)] == list(range(ROWS))


def test_after_a_sigkill_unlock_then_the_same_command_finishes_the_work(tmp_path, server):
    """The README's recovery after SIGKILL (node loss, the driver killed with its jobs): the
    driver leaves its lock and shard 0's status.json marked incomplete; `--unlock`, then the
    very same command (no --rerun-incomplete) resumes the shard and runs the rest."""
    cfg = pipeline(tmp_path, server)
    proc = run_workflow(tmp_path, cfg, background=True)
    wait_for(lambda: committed_rows(tmp_path, 0) >= 2, proc, "shard 0 committed rows")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    kept = committed_rows(tmp_path, 0)
    left = 2 - (tmp_path / "state/shard_1/status.json").exists()  # Snakemake may have run shard 1 first
    assert list((tmp_path / ".snakemake" / "incomplete").iterdir()), "no incomplete mark: the test shows nothing"

    locked = run_workflow(tmp_path, cfg, check=False)
    assert locked.returncode != 0 and "LockException" in locked.text, locked.text[-3000:]
    run_workflow(tmp_path, cfg, "--unlock")
    proc = run_workflow(tmp_path, cfg)
    assert shard_jobs(proc) == left and "wildcards: shard=0" in proc.text, proc.text[-3000:]
    log = (tmp_path / "state/logs/shard_0.log").read_text()
    assert f"resuming shard 0: {kept} rows already committed are skipped" in log
    assert [r["source_index"] for r in merged_rows(tmp_path)] == list(range(ROWS))


# --------------------------------------------------------------------------- a signal during start-up


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_while_the_engine_is_imported_is_recorded_as_that_signal(tmp_path, signum):
    """A SLURM time limit that came while transformers was importing was recorded as
    "ModuleNotFoundError: Could not import module 'AutoModelForCausalLM'" (transformers wraps
    what the signal raised inside its import): it must say the signal."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(4)))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(pipeline_config(
        data, model=model, state_dir=tmp_path / "state", output_dir=tmp_path / "out", processor={"backend": "transformers"},
    )))  # fmt: skip
    index_datasets(load_config(str(config)))
    importing = tmp_path / "importing"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAKES / "slow_transformers"), os.environ.get("PYTHONPATH", "")]),
        "SLOW_TRANSFORMERS_IMPORTING": str(importing),
    }
    log = tmp_path / "state" / "logs" / "shard_0.log"
    cmd = [sys.executable, "-m", "mirageflow.jobs", "--config", str(config), "--log", str(log), "shard", "0"]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 180
    while not importing.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert importing.exists(), f"the job never reached the engine's import (exit {proc.poll()}):\n{log.read_text()[-3000:]}"
    os.kill(proc.pid, signum)
    assert proc.wait(timeout=60) == 128 + signum, log.read_text()[-3000:]
    failure = json.loads((tmp_path / "state/shard_0/failure.json").read_text())
    name = signal.Signals(signum).name
    assert failure["signal"] == name, failure
    assert failure["error"].startswith(f"ShardInterrupted: interrupted by {name}"), failure["error"]
    assert "ModuleNotFoundError" not in failure["error"]
    assert failure["committed"] == "0 rows"


# --------------------------------------------------------------------------- no work, no engine


def test_a_shard_with_every_row_committed_finishes_without_loading_an_engine(tmp_path):
    """A shard stopped after its last commit (its status.json never written) is run again: it
    has nothing to compute, so it loads no engine (68 s of model load for zero work before)."""
    cfg = shard_config(tmp_path, [{"q": f"question {i}"} for i in range(5)], [{"name": "a", "prompt": "{{ q }}"}])
    first = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda prompt: "answer"))
    records = (tmp_path / "out" / "shard_0").glob("*")
    before = sorted(p.read_bytes() for p in records)
    assert first["stats"]["rows_processed"] == 5
    (tmp_path / "state" / "shard_0" / "status.json").unlink()  # stopped between the last commit and the status

    made = []

    def no_engine(processor, batch_size, **kw):
        made.append(processor)
        raise AssertionError("an engine was made for a shard with nothing to do")

    status = run_shard(cfg, 0, engine_factory=no_engine)
    assert made == [] and status["status"] == "success" and status["engines"] == {}
    st = status["stats"]
    assert st["rows_resumed"] == 5 and st["attempts"][-1]["rows_computed"] == 0
    # this attempt adds no load time: nothing for the load_dominates finding to count
    assert st["model_load_seconds"] == first["stats"]["model_load_seconds"]
    assert sorted(p.read_bytes() for p in (tmp_path / "out" / "shard_0").glob("*")) == before


# --------------------------------------------------------------------------- the last good result stays


def test_an_edit_then_an_interrupt_keeps_the_previous_results_readable_and_marked(tmp_path, server):
    """The reported history: a finished run, a prompt edit, the rerun interrupted. The previous
    merged output and report stay readable, marked as the previous run's, until the edited run's
    replace them."""
    cfg = pipeline(tmp_path, server)
    server.behaviour.latency = 0.0
    try:
        run_workflow(tmp_path, cfg)
    finally:
        server.behaviour.latency = LATENCY
    before = merged_rows(tmp_path)
    assert len(before) == ROWS
    state = tmp_path / "state"

    cfg["processing_params"]["outputs"][0]["prompt"] = "Condense: {{ text }}"
    proc = run_workflow(tmp_path, cfg, background=True)
    asked = len(server.records)
    wait_for(lambda: len(server.records) >= asked + 2, proc, "the edited run's shard 0 asked two rows")
    out = stop(proc, signal.SIGINT, "driver")
    assert merged_rows(tmp_path) == before  # readable as it was
    marked = json.loads((state / "previous_results.json").read_text())
    assert {"state/metrics.json", "state/report.html", "out/merged"} <= set(marked["outputs"]), marked
    assert "The results of a previous run" in (state / "report.html").read_text()
    assert json.loads((state / "metrics.json").read_text())["previous_run"]["why"] == marked["why"]
    summary = out[out.index("mirageflow: run interrupted") :]
    assert "the previous run's results, kept until this run's replace them" in summary and "out/merged/" in summary, summary

    run_workflow(tmp_path, cfg)
    after = merged_rows(tmp_path)
    assert [r["source_index"] for r in after] == list(range(ROWS)) and after != before
    assert not (state / "previous_results.json").exists()
    assert "previous run" not in (state / "report.html").read_text()
    assert "previous_run" not in json.loads((state / "metrics.json").read_text())
