"""Deterministic contiguous sharding (MMIRAGE's formula, so shard ids mean the same rows)."""


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
