"""Issue 22, items 5-8: a custom step (user code) can only fail its own row. Whatever the
function does (SystemExit, KeyboardInterrupt, os._exit, a signal to itself, an invalid
string, a killed or OOM-killed worker, every worker killed at once), it becomes a row error
with a class, the worker is replaced, the rows in flight are retried once, and no row is
ever missing; a real cancellation of the job is still told apart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mirageflow.config import load_config
from mirageflow.data.writers import read_parts
from mirageflow.config.types import CustomProcessor
from mirageflow.shard.steps.python import FunctionPool
from mirageflow.errors import RowError
from mirageflow.shard.runner import index_datasets, run_shard

SCRIPT = """
import os, signal, sys, time

def f(v):
    q = v["q"]
    if q == "exit":
        sys.exit(1)
    if q == "kbd":
        raise KeyboardInterrupt("pressed")
    if q == "os_exit":
        os._exit(15)
    if q == "selfterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    if q == "surrogate":
        return "bad \\ud800 text"
    if q == "surrogate_key":
        return {"\\udc00": 1}
    if q == "oom":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    if q.startswith("slow"):
        time.sleep(1.0)
    return q.upper()
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("steps") / "steps.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def pool(script):
    p = FunctionPool(CustomProcessor("custom", str(script), "f", max_workers=2, start_method="fork"))
    p.start()
    yield p
    p.close()


def call(pool, q):
    return asyncio.run(pool.call({"q": q}, "output 'c'"))


def row_error(pool, q) -> RowError:
    with pytest.raises(RowError) as e:
        call(pool, q)
    return e.value


@pytest.mark.parametrize(
    "q, kind, message",
    [
        ("exit", "custom_error", "SystemExit: the function called sys.exit(1)"),  # item 5
        ("kbd", "custom_error", "KeyboardInterrupt: pressed"),  # item 5
        ("os_exit", "custom_crashed", "exit code 15"),  # item 6: not a job cancellation
        ("selfterm", "custom_crashed", "killed by SIGTERM"),  # item 6
        ("surrogate", "custom_bad_value", "lone surrogate"),  # item 7
        ("surrogate_key", "custom_bad_value", "lone surrogate"),  # item 7
        ("oom", "custom_crashed", "killed by SIGKILL"),  # item 8
    ],
)
def test_items5_to_8_whatever_the_function_does_is_its_rows_error(pool, q, kind, message):
    """Items 5, 6, 7, 8: SystemExit, KeyboardInterrupt, os._exit(15), a self-sent SIGTERM, a
    lone surrogate and a SIGKILLed worker are each a row error with a class, and the pool
    serves the next row."""
    e = row_error(pool, q)
    assert (e.stage, e.kind) == ("custom", kind) and message in str(e), str(e)
    assert call(pool, "next") == "NEXT"


def test_item8_rows_in_flight_when_every_worker_is_killed_are_retried_and_succeed(pool):
    """Item 8: killing every worker of the pool (the OOM killer, twice) broke the pool and
    failed the rows in flight; now each is retried once on a new worker."""

    async def scenario():
        calls = [asyncio.ensure_future(pool.call({"q": f"slow{i}"}, "output 'c'")) for i in range(6)]
        await asyncio.sleep(0.5)  # the first batches are running
        for worker in pool._workers:
            os.kill(worker.process.pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

    results = asyncio.run(scenario())
    assert results == [f"SLOW{i}" for i in range(6)], results
    assert call(pool, "after") == "AFTER"


def test_item6_a_real_cancellation_stops_the_shard_instead_of_failing_rows(tmp_path, script):
    """Item 6: a SIGTERM sent to the shard process (and to its workers, as scancel does) stops
    the shard (failure.json names the signal, the rows in flight are not row errors); a
    rerun then finishes every row."""
    cfg = _config(tmp_path, script, ["slow"] * 6)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    runner = tmp_path / "run.py"
    runner.write_text(
        textwrap.dedent(f"""
        import json
        from mirageflow.config import load_config
        from mirageflow.shard.runner import index_datasets, run_shard
        if __name__ == "__main__":  # spawned workers import this file again
            cfg = load_config(json.loads(open({str(tmp_path / "cfg.json")!r}).read()))
            index_datasets(cfg)
            run_shard(cfg, 0)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(runner)], start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    time.sleep(6)  # workers started (spawn) and the first slow rows running
    os.killpg(proc.pid, signal.SIGTERM)  # the shard and its workers, as scancel does
    assert proc.wait(60) != 0
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure["signal"] == "SIGTERM", failure["error"]
    errors = tmp_path / "state" / "shard_0" / "errors.jsonl"
    assert not errors.exists() or not errors.read_text().strip(), errors.read_text()
    status = run_shard(load_config(cfg), 0, attempt=2)
    assert (status["stats"]["rows_processed"], status["stats"]["rows_failed"]) == (6, 0)


def _config(tmp_path: Path, script: Path, rows: list[str], workers: int = 1) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": q}) + "\n" for q in rows))
    return {
        "processors": [{"type": "custom", "script_path": str(script), "function_name": "f", "max_workers": workers}],
        "loading_params": {
            "state_dir": str(tmp_path / "state"),
            "datasets": [{"path": str(data), "type": "jsonl", "output_dir": str(tmp_path / "out")}],
        },
        "shard_params": {"max_error_rate": 0.5, "checkpoint_rows": 5, "checkpoint_min_seconds": 0},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "c", "type": "custom"}],
                              "remove_columns": True, "output_schema": {"q": "{{ q }}", "c": "{{ c }}"}},
    }  # fmt: skip


def test_item8_an_oom_killed_worker_fails_one_row_and_no_row_is_missing(tmp_path, script):
    """Item 8: with max_workers 1, a row whose worker the OOM killer ends failed 29 rows
    (BrokenProcessPool) and left records missing until a retry_failed_rows rerun; now it is
    one custom_crashed row, every other row is a record, the shard succeeds."""
    rows = [f"r{i}" for i in range(30)]
    rows[7] = "oom"
    rows[20] = "exit"
    cfg = load_config(_config(tmp_path, script, rows))
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    st = status["stats"]
    assert (st["rows_processed"], st["rows_failed"]) == (28, 2)
    assert st["rows_failed_by_class"] == {"custom_crashed": 1, "custom_error": 1}
    records = read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist()
    assert sorted(r["source_index"] for r in records) == [i for i in range(30) if i not in (7, 20)]
    assert all(r["c"] == r["q"].upper() for r in records)
