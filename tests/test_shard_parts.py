"""The shard runner's collaborators, each on its own, without an engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from tqdm import tqdm

from mirageflow.data.readers import SourceRow
from mirageflow.errors import RowError, RowErrorClass
from mirageflow.shard.budget import ErrorBudget
from mirageflow.shard.commits import CommitQueue
from mirageflow.shard.failures import ShardFailed, ShardInterrupted
from mirageflow.shard.row_feeder import RowFeeder
from mirageflow.shard.signals import StopSignals
from mirageflow.shard.steps.base import FILTERED
from mirageflow.stats.formulas import PhaseTimer


def _params(**kw):
    base = dict(
        max_errors=None, max_error_rate=0.5, min_rows_for_error_rate=4, checkpoint_rows=3, checkpoint_seconds=30.0,
        checkpoint_min_seconds=0.0,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


# --------------------------------------------------------------------------- RowFeeder


def _feeder(n: int, committed_before: set[int], **params):
    """A feeder of n samples per row over one dataset whose units ``committed_before`` were committed at resume;
    what it books goes to ``booked``."""
    booked = []
    cfg = SimpleNamespace(shard=_params(**params), n_samples=n, datasets=[SimpleNamespace(index=0)])
    commits = SimpleNamespace(
        add=lambda ds, record, error, tally=None: booked.append(("add", ds, record, error)),
        add_filtered=lambda ds, unit: booked.append(("filtered", ds, unit)),
    )  # fmt: skip
    feeder = RowFeeder(cfg, 3, None, ErrorBudget(cfg.shard, 3, "errors.jsonl"), SimpleNamespace(take_tally=lambda *a: None), None)
    feeder.begin(SimpleNamespace(committed_before=lambda ds: committed_before.__contains__), commits)
    feeder.bar = tqdm(disable=True)
    return feeder, booked


def test_row_feeder_counts_a_row_when_its_last_pending_sample_is_booked():
    feeder, booked = _feeder(3, committed_before={0})  # row 0's sample 0 was committed before this attempt
    row0, row1 = SourceRow(0, {"q": "a"}), SourceRow(1, {"q": "b"})
    feeder.finished(0, row0, {"a": 1}, None, 1)
    feeder.finished(0, row1, FILTERED, None, 0)
    assert feeder.rows_finished == 0
    feeder.finished(0, row0, {"a": 2}, None, 2)
    assert feeder.rows_finished == 1  # row 0: samples 1 and 2 were its pending ones
    feeder.finished(0, row1, {"a": 3}, None, 1)
    feeder.finished(0, row1, {"a": 4}, None, 2)
    assert feeder.rows_finished == 2
    assert ("filtered", 0, 3) in booked and len(booked) == 5  # row 1 sample 0: unit 1 * 3 + 0


def test_row_feeder_books_a_row_error_and_halts_on_the_budgets_verdict_the_first_reason_kept():
    feeder, booked = _feeder(1, committed_before=set(), max_errors=1)
    error = RowError("parse", RowErrorClass.JSON_PARSE, "not JSON from http://user:secretpw@h:1/v1", raw="{")
    feeder.finished(0, SourceRow(4, {}), None, error)
    assert feeder.abort is None
    feeder.finished(0, SourceRow(5, {}), None, error)  # the second error: past max_errors
    assert isinstance(feeder.abort, ShardFailed) and "shard 3" in str(feeder.abort)
    feeder.halt(RuntimeError("later"))
    assert isinstance(feeder.abort, ShardFailed)  # the first reason wins
    (_, ds, record, entry) = booked[0]
    assert (ds, record, entry["source_index"], entry["error"], entry["raw"]) == (0, None, 4, "json_parse", "{")
    assert "secretpw" not in entry["message"] and "sample_index" not in entry


# --------------------------------------------------------------------------- ErrorBudget


def test_budget_rate_applies_only_after_min_rows():
    b = ErrorBudget(_params(), 7, "errors.jsonl")
    assert b.record_failure("json_parse") is None  # 1 of 1 failed, but too few rows to judge
    assert b.record_ok() is None
    assert b.record_failure("json_parse") is None
    verdict = b.record_failure("empty_output")  # 3 of 4 > 0.5
    assert isinstance(
        verdict, ShardFailed
    ) and "error budget exceeded in shard 7: 3 of 4 rows failed (json_parse: 2, empty_output: 1)" in str(verdict)


def test_budget_counts_earlier_attempts_and_max_errors():
    b = ErrorBudget(_params(max_errors=2, max_error_rate=1.0), 0, "e")
    b.resume(10, Counter({"aborted": 2}))
    assert b.totals() == (10, 2) and b.computed == 0
    assert "3 of 13 rows failed" in str(b.record_failure("aborted"))
    assert b.failed_classes() == Counter({"aborted": 3}) and b.computed == 1


def test_budget_final_fails_when_every_row_failed_even_below_min_rows():
    b = ErrorBudget(_params(max_error_rate=1.0), 0, "e")
    b.record_failure("x")
    assert b.final() is not None and "every row of shard 0" in str(b.final())
    b2 = ErrorBudget(_params(max_error_rate=1.0), 0, "e")
    assert b2.final() is None  # an empty shard succeeds with zero rows
    b2.record_ok()
    b2.record_failure("x")
    assert b2.final() is None


# --------------------------------------------------------------------------- CommitQueue


class FakeCheckpoint:
    def __init__(self, fail=False):
        self.commits, self.saves, self.fail = [], 0, fail

    def commit(self, ds, records, errors, filtered=(), tally=None):
        if self.fail:
            raise OSError(28, "No space left on device")
        self.commits.append((ds, list(records), list(errors)))

    def save(self):
        self.saves += 1


class FakeLease:
    def __init__(self):
        self.lost = False

    def check(self):
        if self.lost:
            raise RuntimeError("lost lease.json")


def test_commit_queue_batches_and_flushes():
    cp, before = FakeCheckpoint(), []
    q = CommitQueue(cp, FakeLease(), _params(), PhaseTimer(), 0, before_write=lambda: before.append(1))
    q.add(0, {"source_index": 0}, None)
    q.add(1, None, {"source_index": 5})
    assert cp.commits == [] and q.pending_rows == 2  # no writer thread yet: nothing written
    q.flush()
    assert cp.commits == [(0, [{"source_index": 0}], []), (1, [], [{"source_index": 5}])]
    assert before == [1] and q.pending_rows == 0
    q.flush()  # nothing pending: the manifest is still saved (the attempt's counters)
    assert cp.saves == 1


def test_commit_queue_writes_in_its_thread_when_due_and_reports_failures():
    async def scenario(cp, lease):
        failures = []
        q = CommitQueue(cp, lease, _params(checkpoint_rows=2), PhaseTimer(), 3)
        q.on_failure = failures.append
        q.start()
        for i in range(5):
            q.add(0, {"source_index": i}, None)
            await asyncio.sleep(0.01)
        await q.drain()
        q.stop()
        return q, failures

    cp = FakeCheckpoint()
    q, failures = asyncio.run(scenario(cp, FakeLease()))
    assert failures == [] and sum(len(c[1]) for c in cp.commits) + q.pending_rows == 5 and cp.commits

    q, failures = asyncio.run(scenario(FakeCheckpoint(fail=True), FakeLease()))
    assert failures and "cannot commit finished rows of shard 3: [Errno 28] No space left" in str(failures[0])
    assert q.failed is failures[0]

    lease = FakeLease()
    lease.lost = True
    q, failures = asyncio.run(scenario(FakeCheckpoint(), lease))
    assert "lost lease.json" in str(failures[0])


# --------------------------------------------------------------------------- StopSignals


def _interrupted(signum):
    return ShardInterrupted(signum, "0 rows")


def test_signals_raise_outside_the_loop_and_restore_handlers():
    stopped = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ShardInterrupted, match="SIGTERM"):
        with StopSignals(stopped.append, _interrupted) as guard:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler raises here
    assert stopped == [signal.SIGTERM] and guard.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_signals_on_the_loop_call_stop_then_raise_again_after_detach():
    stopped, calls = [], []

    async def main(guard):
        loop = asyncio.get_running_loop()
        guard.attach(loop, lambda: calls.append("stop"))
        await asyncio.sleep(0.05)
        guard.detach()

    with StopSignals(stopped.append, _interrupted) as guard:
        asyncio.run(main(guard))
        assert calls == [] and stopped == []
        with pytest.raises(ShardInterrupted, match="SIGINT"):  # outside the loop again: the signal raises
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert stopped == [signal.SIGINT]


def test_only_the_first_signal_counts_on_the_loop_and_after_it():
    """A terminal's Ctrl-C reaches the job with its group and the driver forwards the same
    signal: the second one is ignored, so it cannot break off the commit the first started."""
    stopped, calls = [], []

    async def main(guard):
        loop = asyncio.get_running_loop()
        guard.attach(loop, lambda: calls.append("stop"))
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.05)
        guard.detach()

    with StopSignals(stopped.append, _interrupted) as guard:
        asyncio.run(main(guard))
        assert calls == ["stop"] and stopped == [signal.SIGINT] and guard.signum == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)  # after detach too: logged, not raised
        time.sleep(0.2)
        assert stopped == [signal.SIGINT]


# --------------------------------------------------------------------------- ShardMetrics


def test_metrics_sum_over_attempts_and_rate_from_the_sums():
    from mirageflow.config import load_config
    from mirageflow.shard.metrics import ShardMetrics

    cfg = load_config(
        {
            "processors": [{"type": "llm", "server_args": {"model_path": "unused"}}],
            "loading_params": {"datasets": [{"path": "x.jsonl", "type": "JSONL", "output_dir": "out"}], "state_dir": "st"},
            "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}]},
        },
        check_paths=False,
    )
    m = ShardMetrics(cfg, attempt=2)
    m.output_tokens, m.input_tokens, m.requests = 40, 100, 4
    m.tracker.submitted()
    time.sleep(0.01)
    m.tracker.completed()
    earlier = {
        "attempt": 1,
        "outcome": "killed",
        "output_tokens": 60,
        "input_tokens": 1,
        "requests": 6,
        "rows_computed": 6,
        "inference_runtime_seconds": 1.0,
        "runtime_seconds": 5.0,
        "peak_inflight": 9,
        "output_tokens_per_row_hist": {"buckets": [[10, 11, 6]], "rows": 6, "sum": 60, "min": 10, "max": 10, "mean": 10.0},
    }
    budget = ErrorBudget(_params(), 0, "e")
    budget.resume(6, Counter())
    budget.record_ok()
    st = m.stats(budget, resumed=6, attempts=[earlier, m.attempt_entry(1)])
    assert (st["output_tokens"], st["requests"], st["rows_computed"], st["rows_processed"]) == (100, 10, 7, 7)
    assert st["inference_runtime_seconds"] > 1.0 and st["peak_inflight"] == 9
    assert st["tokens_per_sec"] == pytest.approx(100 / st["inference_runtime_seconds"])
    # the tokens histogram counts committed records (the checkpoint's parts: none here), not the attempts' work
    assert st["output_tokens_per_row_hist"]["rows"] == 0
    assert [a["outcome"] for a in st["attempts"]] == ["killed", "running"]
    assert "output_tokens_per_row_hist" not in st["attempts"][0]
