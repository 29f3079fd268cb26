"""The proof behind a success: every row of the shard's range is a record, a row error or a
row a filter step dropped, once. With n_samples > 1 the same holds for every sample: the
checkpoint counts units, ``source_index * n + sample_index`` (mirageflow/shard/samples.py), and a
shard's range of units is its row range times n."""

from __future__ import annotations

from mirageflow.config.types import PipelineConfig
from mirageflow.shard.manifest import merge_ranges, to_ranges
from mirageflow.shard.samples import describe
from mirageflow.shard.failures import ShardFailed
from mirageflow.state.layout import image_file


def check_accounting(cfg: PipelineConfig, checkpoint, slices, shard_id: int) -> list[dict]:
    """Per dataset: committed records + row errors must be exactly the shard's row range, each
    source index once; else ShardFailed naming the gap. Returns status.json's ``datasets``."""
    per_dataset = []
    n = cfg.n_samples
    for ds, piece in zip(cfg.datasets, slices):
        prog = checkpoint.datasets[ds.index]
        start, stop = piece.start * n, piece.stop * n  # units (= rows when n is 1)
        covered = merge_ranges(merge_ranges(prog.ranges("done"), prog.ranges("failed")), prog.ranges("filtered"))
        expected = [[start, stop]] if stop > start else []
        if covered != expected or len(prog.done) + len(prog.failed) + len(prog.filtered) != stop - start:
            rows = set(range(start, stop))
            missing = to_ranges(rows - prog.done - prog.failed - prog.filtered)
            both = (prog.done & prog.failed) | (prog.filtered & (prog.done | prog.failed))
            extra = to_ranges(both | ((prog.done | prog.failed | prog.filtered) - rows))
            what = "" if n == 1 else f" x {n} samples"
            raise ShardFailed(
                f"shard {shard_id}, dataset {ds.index} ({ds.path}): rows [{piece.start}, {piece.stop}){what} should be "
                f"{stop - start} records + row errors + filtered rows, found {len(prog.done)} + {len(prog.failed)} "
                f"+ {len(prog.filtered)}; "
                f"rows neither written nor recorded: {describe(missing[:10], n)}; "
                f"rows in both or outside the range: {describe(extra[:10], n)}"
            )
        per_dataset.append({
            "path": ds.path, "output_dir": str(prog.out_dir), "row_range": [piece.start, piece.stop],
            "rows_processed": len(prog.done), "rows_failed": len(prog.failed), "rows_filtered": len(prog.filtered),
            "parts": prog.parts,
        })  # fmt: skip
    return per_dataset


def check_images(cfg: PipelineConfig, checkpoint, images, shard_id: int) -> None:
    """Every record of an image_gen output points to its image: the image ledger lists the
    record's unit and the file is there with the size it was written with; else ShardFailed
    naming the first files missing."""
    import os

    names = [o.name for o in cfg.outputs if o.kind == "image_gen"]
    n = cfg.n_samples
    missing = []
    for ds in cfg.datasets:
        first, before = images.starts[ds.index]
        out_dir = images.out_dirs[ds.index]
        for unit in checkpoint.datasets[ds.index].done:
            position = before + unit - first * n
            for name in names:
                entry = checkpoint.images.get(name, ds.index, position)
                path = image_file(out_dir, entry["path"]) if entry else None
                if entry is None or not os.path.isfile(path) or os.path.getsize(path) != entry["bytes"]:
                    missing.append(f"{name} of unit {unit} of dataset {ds.index}" + (f" ({path})" if path else " (not in images.jsonl)"))
    if missing:
        raise ShardFailed(
            f"shard {shard_id}: {len(missing)} record(s) point to an image that is not there or not the one written: "
            f"{'; '.join(missing[:10])}. Restore the files, or delete {checkpoint.path} to recompute the shard"
        )
