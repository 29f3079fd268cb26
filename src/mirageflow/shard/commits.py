"""Finished rows on their way to disk: pending batches, the writer thread, the commit ticker.

Rows are committed every ``checkpoint_rows`` rows (but not more often than every
``checkpoint_min_seconds``) or every ``checkpoint_seconds``. During generation a writer
thread makes a batch durable (part file, fsync, manifest) while the event loop goes on
feeding the engine; while one batch is being written the next one grows. After the loop,
``flush`` writes what is left in the calling thread.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from mirageflow.shard.failures import ShardFailed
from mirageflow.shard.tally import RecordTally, UnitTally


class CommitQueue:
    def __init__(self, checkpoint, lease, params, timer, shard_id: int, before_write: Callable[[], None] = lambda: None, cache=None):
        """``before_write``: called on the event loop when a batch is taken, so that what it
        records (the attempt's counters) is saved in the same manifest write as the rows.
        ``cache``: the request cache, whose new answers are committed with each batch."""
        self.checkpoint, self.lease, self.params, self.timer = checkpoint, lease, params, timer
        self.cache = cache
        self.shard_id = shard_id
        self.before_write = before_write
        # dataset -> (records, error entries, filtered indices, the records' tally: shard/tally.py)
        self._pending: dict[int, tuple[list, list, list, RecordTally]] = {}
        self.pending_rows = 0
        self._last_commit = time.monotonic()
        self._writer: ThreadPoolExecutor | None = None
        self._writing: asyncio.Future | None = None
        self.failed: BaseException | None = None  # the writer's error (disk full, lost lease)
        self.on_failure: Callable[[BaseException], None] = lambda e: None

    # ------------------------------------------------------------------ booking

    def add(self, ds_index: int, record: dict | None, error: dict | None, tally: UnitTally | None = None) -> None:
        """One finished row: its record (and what it holds, ``tally``) or its error entry.
        Hands a batch to the writer when due."""
        records, errors, _, tallies = self._pending.get(ds_index) or self._new(ds_index)
        if error is None:
            records.append(record)
            if tally is not None:
                tallies.add(tally)
        else:
            errors.append(error)
        self._added()

    def add_filtered(self, ds_index: int, source_index: int) -> None:
        """One row a filter step dropped: only its index is committed (to the manifest)."""
        (self._pending.get(ds_index) or self._new(ds_index))[2].append(source_index)
        self._added()

    def _new(self, ds_index: int) -> tuple[list, list, list, RecordTally]:
        pending = self._pending[ds_index] = ([], [], [], RecordTally())
        return pending

    def _added(self) -> None:
        self.pending_rows += 1
        if self._writer is not None and self.pending_rows >= self.params.checkpoint_rows and self._allowed():
            self.commit_soon()

    def _allowed(self) -> bool:
        return time.monotonic() - self._last_commit >= self.params.checkpoint_min_seconds

    def _take(self) -> dict[int, tuple[list, list, list, RecordTally]]:
        self.before_write()
        batch = {k: v for k, v in self._pending.items() if v[0] or v[1] or v[2]}
        self._pending = {}
        self.pending_rows = 0
        self._last_commit = time.monotonic()
        return batch

    # ------------------------------------------------------------------ writing

    def _write(self, batch: dict[int, tuple[list, list, list, RecordTally]]) -> None:
        """Make a batch durable (one thread at a time). The lease is checked first: a shard
        taken over by another job must not write next to it."""
        self.lease.check()
        with self.timer.phase("write"):
            try:
                if self.cache is not None:  # the answers first: a kill before the manifest loses no answer of a committed row
                    self.cache.commit()
                for ds_index, (records, errors, filtered, tally) in batch.items():
                    self.checkpoint.commit(ds_index, records, errors, filtered, tally)
                if not batch:
                    self.checkpoint.save()  # the attempt's counters, with no new rows
            except OSError as e:  # disk full, quota, read-only output
                raise ShardFailed(
                    f"cannot commit finished rows of shard {self.shard_id}: {e}; the rows committed "
                    "before are intact and a rerun resumes from them"
                ) from e

    def start(self) -> None:
        """Commits go to a writer thread from now on (call on the event loop's thread)."""
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"shard{self.shard_id}-writer")

    def commit_soon(self) -> None:
        """On the event loop: hand what is finished to the writer thread, unless it is still
        writing the last batch (then the rows wait for the next call and the batch grows)."""
        if self._writing is not None and not self._writing.done():
            return
        self._writing = asyncio.get_running_loop().run_in_executor(self._writer, self._write, self._take())
        self._writing.add_done_callback(self._written)

    def _written(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.failed = self.failed or future.exception()
            self.on_failure(future.exception())

    async def ticker(self) -> None:
        """Commits on time even when rows trickle in."""
        period = self.params.checkpoint_seconds
        while True:
            await asyncio.sleep(min(period, 1.0))
            if time.monotonic() - self._last_commit >= period or (self.pending_rows >= self.params.checkpoint_rows and self._allowed()):
                self.commit_soon()

    async def drain(self) -> None:
        """Wait for the batch being written (its error, if any, is in ``failed``)."""
        if self._writing is not None:
            await asyncio.wait([self._writing])

    def stop(self) -> None:
        """No more writer thread; later commits are written by ``flush``."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def flush(self) -> None:
        """Commit everything finished, now, in this thread (outside the event loop)."""
        self._write(self._take())
