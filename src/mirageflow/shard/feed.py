"""The units a shard feeds: its rows (with n_samples > 1 their samples) still to do, read in
source order, dataset after dataset, each once (shard/samples.py numbers them).

The runner's workers (shard/runner.py) take them from one shared iterator; ``mmirage
preview`` (shard/preview.py) runs its first rows the same way. A dataset that cannot be
read fails the shard naming it; a row that cannot be read is a RowError value, not an
exception (data/readers.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

from mirageflow.config.types import DatasetConfig
from mirageflow.data.readers import ShardSlice, SourceRow, read_shard
from mirageflow.shard.failures import ShardFailed


def pending(ds_index: int, read, done, n: int, grouped: bool = False) -> Iterator[tuple[int, SourceRow, int | list[int] | None]]:
    """(dataset index, row, sample) for every unit of one dataset not committed yet, in
    source order; sample None when n == 1. ``read(skip=...)`` reads the shard's rows, skipping
    source indexes for which ``skip`` is true; ``done(unit)`` says a unit is committed. With
    n > 1 a row is read while any of its samples is not committed. ``grouped`` (n > 1): one
    item per row, with the list of its pending sample indexes."""
    if n == 1:
        for row in read(skip=done):
            yield ds_index, row, None
        return
    for row in read(skip=lambda i: all(done(i * n + k) for k in range(n))):
        todo = [k for k in range(n) if not done(row.index * n + k)]
        if grouped:
            yield ds_index, row, todo
        else:
            for k in todo:
                yield ds_index, row, k


def shard_units(
    shard_id: int, datasets: list[DatasetConfig], slices: list[ShardSlice], committed: Callable[[int], Callable[[int], bool]],
    n: int, grouped: bool, columns: frozenset[str] | None = None,
):  # fmt: skip
    """``pending`` over every dataset of the shard (``slices``: where its rows are in each);
    ``committed(dataset)`` says which units of a dataset were committed; ``columns``: the
    top-level columns a Parquet or Hugging Face dataset decodes (None: all). ShardFailed,
    naming the dataset, when one cannot be read."""
    for ds, piece in zip(datasets, slices):
        try:
            read = functools.partial(read_shard, ds, piece, columns=columns)
            yield from pending(ds.index, read, committed(ds.index), n, grouped)
        except Exception as e:  # a row that could be isolated is a RowError value, not an exception
            raise ShardFailed(f"cannot read dataset {ds.index} ({ds.path}), shard {shard_id}: {type(e).__name__}: {e}") from e


def first_rows(slices: list[ShardSlice], limit: int) -> list[ShardSlice]:
    """The slices cut to their first ``limit`` rows in all (a slice keeps its start, offset and line)."""
    out = []
    for piece in slices:
        take = max(0, min(limit, piece.stop - piece.start))
        out.append(piece._replace(stop=piece.start + take))
        limit -= take
    return out
