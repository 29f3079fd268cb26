"""The numbers after any history are the numbers of the records (shard/tally.py).

One shard of 10 rows x 2 samples x 2 outputs against the fake OpenAI server (a real HTTP
server in a thread) goes through what users do: the shard job interrupted (SIGTERM), then
killed (SIGKILL), then the same run to the end, answering from the request cache what
the killed attempts had asked; then a prompt edit reruns it, the unchanged output all from
the cache. After each step every figure is checked against the records in the output: the
samples and rows, the tokens histogram, the output tokens (cached ones told apart), the
answers and those cut at max_new_tokens (the length_cut finding), n_samples before any
shard completed, and which span the wall clock covers.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer

from mirageflow.config import load_config
from mirageflow.report.aggregate import compute_metrics, write_report
from mirageflow.report.html import tokens_hist_labels
from mirageflow.shard.runner import index_datasets, run_shard
from mirageflow.stats.formulas import parse_time

pytestmark = pytest.mark.usefixtures("no_proxy")

ROWS, N = 10, 2
MAX_TOKENS = 4  # the fake answers 1 + len(prompt) % 7 words: some reach the limit ("length")


def _raw(root: Path, server: FakeServer, title_prompt: str = "Title for {{ text }}: {{ summary }}") -> dict:
    data = root / "in.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"passage number {i} " + "x" * i}) + "\n" for i in range(ROWS)))
    return pipeline_config(
        data, inputs=["text"], model="fake-model", state_dir=root / "state", output_dir=root / "out",
        outputs=[{"name": "summary", "prompt": "Summarise: {{ text }}"}, {"name": "title", "prompt": title_prompt}],
        dataset={"output_format": "jsonl"},
        processor={"backend": "openai", "base_url": server.url + "/v1", "max_retries": 0, "request_timeout": 30,
                   "default_sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.7}},
        processing={"n_samples": N, "output_schema": {"summary": "{{ summary }}", "title": "{{ title }}"}},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 1, "checkpoint_min_seconds": 0, "max_inflight": 2},
    )  # fmt: skip


def _job(root: Path, raw: dict) -> subprocess.Popen:
    """The shard job as the workflow runs it (python -m mirageflow.jobs ... shard 0)."""
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mirageflow.jobs", "--config", str(path), "--log", str(root / "shard.log"), "shard", "0"]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_after(server: FakeServer, job: subprocess.Popen, requests: int, signum: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(server.records) < requests and job.poll() is None:
        time.sleep(0.01)
    assert job.poll() is None, "the shard ended before it could be stopped"
    job.send_signal(signum)
    job.wait(timeout=60)


def _records(root: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((root / "out" / "shard_0").glob("part-*.jsonl")) for line in p.read_text().splitlines()]


def _tokens(answer: str) -> int:
    return len(answer.split())  # the fake's answers: one token per word


def _check_figures(root: Path, raw: dict, cached_outputs: set[str] | None = None) -> dict:
    """Every figure of status.json, metrics.json and the report against the records."""
    records = _records(root)
    assert sorted((r["source_index"], r["sample_index"]) for r in records) == [(i, k) for i in range(ROWS) for k in range(N)]
    tokens = [_tokens(r["summary"]) + _tokens(r["title"]) for r in records]
    answers = [a for r in records for a in (r["summary"], r["title"])]
    cut = sum(1 for a in answers if _tokens(a) >= MAX_TOKENS)
    st = json.loads((root / "state" / "shard_0" / "status.json").read_text())["stats"]
    hist = st["output_tokens_per_row_hist"]
    assert (st["rows_processed"], hist["rows"], hist["sum"]) == (ROWS * N, ROWS * N, sum(tokens))
    assert (hist["min"], hist["max"]) == (min(tokens), max(tokens))
    assert st["record_output_tokens"] == sum(tokens)
    assert (st["record_answers"], st["record_answers_length_cut"]) == (2 * ROWS * N, cut)
    if cached_outputs is not None:  # these outputs' answers all came from the request cache
        assert st["record_output_tokens_cached"] == sum(_tokens(r[o]) for r in records for o in cached_outputs)
    cfg = load_config(copy.deepcopy(raw))
    metrics = write_report(cfg.state_dir, 1, lease_timeout=cfg.shard.lease_timeout_seconds, n_samples=N)
    agg = metrics["aggregate"]
    assert (agg["n_samples"], agg["total_rows_processed"]) == (N, ROWS * N)
    assert agg["output_tokens_per_row_hist"]["rows"] == ROWS * N
    assert agg["total_record_output_tokens"] == agg["output_tokens_per_row_hist"]["sum"] == sum(tokens)
    assert agg["total_record_output_tokens_cached"] == st["record_output_tokens_cached"]
    title, _, _ = tokens_hist_labels(agg["output_tokens_per_row_hist"], agg["n_samples"], 800)
    assert f"{ROWS * N} samples ({ROWS} rows x {N})" in title
    finding = [f for f in metrics["findings"] if f["id"] == "length_cut"]
    if cut / len(answers) > 0.05:
        assert f"({cut} of {len(answers)})" in finding[0]["evidence"]
    # the wall clock: while an attempt ran (the attempts are one after another here), and the whole span
    attempts = st["attempts"]
    assert agg["wall_clock_runtime_seconds"] == pytest.approx(sum(a["runtime_seconds"] for a in attempts))
    first, last = parse_time(attempts[0]["started_at"]), parse_time(attempts[-1]["finished_at"])
    assert agg["wall_clock_span_seconds"] == pytest.approx((last - first).total_seconds(), abs=0.01)
    if len(attempts) > 1:
        assert agg["wall_clock_span_seconds"] > agg["wall_clock_runtime_seconds"]
    return st


def test_after_interrupt_kill_cached_rerun_and_edit_every_figure_is_the_records(tmp_path):
    server = FakeServer(Behaviour(latency=0.03)).start()
    try:
        raw = _raw(tmp_path, server)
        index_datasets(load_config(copy.deepcopy(raw)))
        _stop_after(server, _job(tmp_path, raw), 12, signal.SIGTERM)  # interrupted: commits what finished
        assert json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())["signal"] == "SIGTERM"
        _stop_after(server, _job(tmp_path, raw), len(server.records) + 12, signal.SIGKILL)  # killed: nothing more saved
        # mid-run, no shard completed: the aggregate says the config's n_samples (mmirage stats, the live report)
        cfg = load_config(copy.deepcopy(raw))
        assert compute_metrics(cfg.state_dir, 1, cfg.shard.lease_timeout_seconds, n_samples=N)["aggregate"]["n_samples"] == N
        sent = len(server.records)
        run_shard(load_config(copy.deepcopy(raw)), 0)  # the same run again, to the end
        st = _check_figures(tmp_path, raw)
        assert [a["outcome"] for a in st["attempts"]] == ["interrupted", "killed", "success"]
        assert st["requests_cached"] > 0 and st["record_output_tokens_cached"] > 0  # answers the stopped attempts had kept
        # the tokens generated in the last attempt are those of its requests, none of a cached answer
        assert st["attempts"][-1]["requests"] == len(server.records) - sent

        edited = _raw(tmp_path, server, title_prompt="A title for {{ text }}: {{ summary }}")
        run_shard(load_config(copy.deepcopy(edited)), 0)  # the edit: summaries from the cache, titles asked again
        st = _check_figures(tmp_path, edited, cached_outputs={"summary"})
        assert [a["outcome"] for a in st["attempts"]] == ["success"]  # the earlier config's attempts made other records
    finally:
        server.stop()
