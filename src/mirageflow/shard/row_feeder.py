"""Feeding a shard's pending units to the engines and booking each one that finishes.

``RowFeeder.feed`` runs ``window`` worker coroutines that share one iterator of the units
still to do (shard/feed.py, in the order shard/prefix_order.py chooses), so up to
``max_inflight`` rows are in flight and the engine always has work queued, with no barrier
between rows. Each worker takes the next row (or a row's pending samples), runs it through
the steps (shard/rows.py ``RowPath``) and books what finished: a record, a filtered row or a
row error, with the ``ErrorBudget`` (which may halt the shard) and the ``CommitQueue``.
``halt`` stops the feeding: the first reason (``abort``) is what the runner raises.

The runner (shard/runner.py) sets the shard up, loads the engines and calls ``feed``; this
class owns only the feeding and the counts it keeps (``rows_finished``).
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Callable

from tqdm import tqdm

from mirageflow.data.readers import ShardSlice, SourceRow
from mirageflow.errors import RowError
from mirageflow.redact import redact_text
from mirageflow.shard import feed, prefix_order
from mirageflow.shard.failures import ShardFailed
from mirageflow.shard.steps.base import FILTERED, Step

if TYPE_CHECKING:
    from mirageflow.config import PipelineConfig
    from mirageflow.shard.budget import ErrorBudget
    from mirageflow.shard.checkpoint import Checkpoint
    from mirageflow.shard.commits import CommitQueue
    from mirageflow.shard.metrics import ShardMetrics
    from mirageflow.shard.rows import RowPath
    from mirageflow.shard.signals import StopSignals

# Rows in flight when no output is an LLM's (custom and filter steps only).
NO_ENGINE_WINDOW = 64


class RowFeeder:
    def __init__(
        self, cfg: PipelineConfig, shard_id: int, rows: RowPath, budget: ErrorBudget, metrics: ShardMetrics,
        columns: frozenset[str] | None,
    ):  # fmt: skip
        self.cfg, self.shard_id, self.params, self.n = cfg, shard_id, cfg.shard, cfg.n_samples
        self.rows, self.budget, self.metrics, self.columns = rows, budget, metrics, columns
        self.checkpoint: Checkpoint | None = None
        self.commits: CommitQueue | None = None
        self.rows_finished = 0  # source rows this attempt finished the last sample of (n_samples > 1)
        self._row_left: dict[tuple[int, int], int] = {}  # (dataset, row) -> samples still to finish
        self._committed: dict[int, Callable[[int], bool]] = {}  # dataset -> was this unit committed before this pass
        self.abort: BaseException | None = None  # why feeding stopped early (first reason wins)
        self._stopping: asyncio.Event | None = None
        self.bar = None  # the tqdm bar of the units done (feed sets it)

    def begin(self, checkpoint: Checkpoint, commits: CommitQueue) -> None:
        """The attempt's checkpoint (restored) and commit queue; what it holds committed is skipped."""
        self.checkpoint, self.commits = checkpoint, commits
        self.skip_committed()

    def skip_committed(self) -> None:
        """Take what is committed now as done before the next pass (after a cache-only pass, too)."""
        self._committed = {ds.index: self.checkpoint.committed_before(ds.index) for ds in self.cfg.datasets}

    # ------------------------------------------------------------------ booking

    def finished(self, ds_index: int, row: SourceRow, record: dict | None, exc: RowError | None, sample: int | None = None) -> None:
        """Book one finished row (its record, FILTERED, or its RowError) with the budget and the commit queue."""
        if record is FILTERED:
            verdict = self.budget.record_filtered()
            self.commits.add_filtered(ds_index, row.index if sample is None else row.index * self.n + sample)
        elif exc is None:
            verdict = self.budget.record_ok()
            self.commits.add(ds_index, record, None, self.metrics.take_tally(ds_index, row.index, sample))
        else:
            entry = {
                "dataset": ds_index,
                "source_index": row.index,
                "stage": exc.stage,
                "error": exc.kind,
                "message": redact_text(str(exc)),
            }
            if sample is not None:
                entry["sample_index"] = sample
            if exc.raw is not None:
                entry["raw"] = exc.raw
            verdict = self.budget.record_failure(exc.kind)
            self.commits.add(ds_index, None, entry)
        if sample is not None:
            self._count_row(ds_index, row.index)
        self.bar.update(1)
        if verdict is not None:
            self.halt(verdict)

    def _count_row(self, ds_index: int, row_index: int) -> None:
        """One more sample of a row finished: count the row once its last pending sample has."""
        key = (ds_index, row_index)
        left = self._row_left.get(key)
        if left is None:  # the row's first sample this attempt: the others committed before need not finish
            committed = self._committed[ds_index]
            left = sum(1 for k in range(self.n) if not committed(row_index * self.n + k))
        if left <= 1:
            self._row_left.pop(key, None)
            self.rows_finished += 1
        else:
            self._row_left[key] = left - 1

    def halt(self, exc: BaseException | None = None) -> None:
        """Stop feeding rows: the shard failed (exc) or was interrupted; rows in flight are cancelled."""
        if exc is not None and self.abort is None:
            self.abort = exc
        if self._stopping is not None:
            self._stopping.set()

    # ------------------------------------------------------------------ feeding

    def feed(self, slices: list[ShardSlice], steps: list[Step], engines: dict, generators: dict, signals: StopSignals) -> None:
        """Run the units still to do through ``steps`` until none is left or the feeding halts; what
        finished is handed to the commit queue (``engines``, ``generators``: what the steps call)."""
        rows_total = sum(piece.stop - piece.start for piece in slices)
        self.bar = tqdm(
            total=rows_total * self.n, initial=self.checkpoint.committed_units(), desc=f"shard {self.shard_id}",
            unit="row" if self.n == 1 else "sample", file=sys.stderr, mininterval=2.0,
        )  # fmt: skip
        try:
            asyncio.run(self._generate(slices, steps, rows_total, [*engines.values(), *generators.values()], generators, signals))
        finally:
            self.bar.close()

    async def _worker(self, rows, steps) -> None:
        """Take the next row (or a row's pending samples), run it through every output, book
        it; until no row is left."""
        try:
            for ds_index, row, sample in rows:
                if self.abort or self._stopping.is_set():
                    return
                try:
                    if sample.__class__ is list:
                        results = await self.rows.row_samples(row, steps, ds_index, sample)
                    else:
                        results = (await self.rows.one(row, steps, ds_index, sample),)
                except ShardFailed as e:  # engine crash, lost connection, a Python step's worker killed by a signal: the shard cannot go on
                    self.halt(e)
                    return
                for k, record, exc in results:
                    self.finished(ds_index, row, record, exc, k)
        except Exception as e:  # reading the dataset failed
            self.halt(e)

    async def _generate(
        self, slices: list[ShardSlice], steps: list[Step], rows_total: int, waiting_on: list, generators: dict, signals: StopSignals
    ) -> None:  # fmt: skip
        main = asyncio.current_task()
        self._stopping = asyncio.Event()
        signals.attach(asyncio.get_running_loop(), lambda: (main.cancel(), self.halt()))
        self.commits.start()
        ticker = asyncio.create_task(self.commits.ticker())
        window = self.params.max_inflight or min((e.max_inflight for e in waiting_on), default=NO_ENGINE_WINDOW)
        # no more workers than units left (a batch engine takes 100,000 at once)
        window = max(1, min(window, rows_total * self.n - self.checkpoint.committed_units()))
        if self.rows.grouped is not None:  # a worker holds a row's n samples
            window = max(1, window // self.n)
        # rows sharing a prompt prefix fed together, for the engine's prefix cache (records unchanged)
        units = feed.shard_units(
            self.shard_id, self.cfg.datasets, slices, self.checkpoint.committed_before, self.n, self.rows.grouped is not None,
            columns=self.columns,
        )  # fmt: skip
        rows = prefix_order.feed_order(self.params.prefix_order, units, steps, self.rows.extract, window)
        try:
            workers = asyncio.gather(*(self._worker(rows, steps) for _ in range(window)))
            stopping = asyncio.create_task(self._stopping.wait())
            try:
                await asyncio.wait([workers, stopping], return_when=asyncio.FIRST_COMPLETED)
            finally:  # stopped, or done: cancelling the gather cancels the workers still running
                workers.cancel()
                stopping.cancel()
                await asyncio.wait([workers, stopping])
                # a cancelled gather finishes with CancelledError as its exception, which
                # asyncio logs as "never retrieved" (a traceback per stopped shard) unless read
                if not workers.cancelled():
                    workers.exception()
        except asyncio.CancelledError:
            if not signals.signum:
                raise
        finally:
            ticker.cancel()
            await self.commits.drain()  # the last batch handed over: written before the loop ends
            signals.detach()
            for generator in generators.values():  # their HTTP clients belong to this loop
                await generator.aclose()
