"""The proof behind a success: every row of the shard's range is a record or a row error, once."""

from __future__ import annotations

from mirageflow.checkpoint import merge_ranges, to_ranges
from mirageflow.shard.failures import ShardFailed


def check_accounting(cfg, checkpoint, slices, shard_id: int) -> list[dict]:
    """Per dataset: committed records + row errors must be exactly the shard's row range, each
    source index once; else ShardFailed naming the gap. Returns status.json's ``datasets``."""
    per_dataset = []
    for ds, piece in zip(cfg.datasets, slices):
        prog = checkpoint.datasets[ds.index]
        covered = merge_ranges(prog.ranges("done"), prog.ranges("failed"))
        expected = [[piece.start, piece.stop]] if piece.stop > piece.start else []
        if covered != expected or len(prog.done) + len(prog.failed) != piece.stop - piece.start:
            rows = set(range(piece.start, piece.stop))
            missing = to_ranges(rows - prog.done - prog.failed)
            extra = to_ranges((prog.done & prog.failed) | ((prog.done | prog.failed) - rows))
            raise ShardFailed(
                f"shard {shard_id}, dataset {ds.index} ({ds.path}): rows [{piece.start}, {piece.stop}) should be "
                f"{piece.stop - piece.start} records + row errors, found {len(prog.done)} + {len(prog.failed)}; "
                f"rows neither written nor recorded: {missing[:10]}; rows in both or outside the range: {extra[:10]}"
            )
        per_dataset.append({
            "path": ds.path, "output_dir": str(prog.out_dir), "row_range": [piece.start, piece.stop],
            "rows_processed": len(prog.done), "rows_failed": len(prog.failed), "parts": prog.parts,
        })  # fmt: skip
    return per_dataset
