"""Deterministic contiguous sharding: MMIRAGE's formula (so shard ids mean the same rows), or
on a Parquet dataset's row-group boundaries (``shard_boundaries: row_groups``)."""

from bisect import bisect_left


def shard_range(num_rows: int, num_shards: int, shard_id: int) -> tuple[int, int]:
    """Half-open row range [start, stop) of shard ``shard_id`` of ``num_shards``.

    The first ``num_rows % num_shards`` shards get one extra row; with fewer rows than
    shards the last shards are empty.
    """
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id {shard_id} is outside 0..{num_shards - 1}")
    div, mod = divmod(num_rows, num_shards)
    start = div * shard_id + min(shard_id, mod)
    return start, start + div + (shard_id < mod)


def row_group_starts(groups: list[int], num_shards: int) -> list[int]:
    """Each shard's first row when shards start only where a row group starts (``groups``: the
    dataset's row groups' row counts, in order): the group start nearest to where MMIRAGE's
    formula would start it (the earlier one on a tie), never before the previous shard's. A
    shard then never decodes a row group only to skip its first rows; with fewer groups than
    shards some shards are empty."""
    edges = [0]
    for n in groups:
        edges.append(edges[-1] + n)
    total, starts = edges[-1], []
    for shard in range(num_shards):
        ideal = shard_range(total, num_shards, shard)[0]
        i = bisect_left(edges, ideal)
        if i == len(edges) or (i > 0 and ideal - edges[i - 1] <= edges[i] - ideal):
            i -= 1
        starts.append(max(edges[i], starts[-1] if starts else 0))
    return starts
