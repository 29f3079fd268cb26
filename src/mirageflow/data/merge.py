"""Merge a dataset's shard outputs into <output_dir>/merged/, in source order."""

from __future__ import annotations

import json
from pathlib import Path

from mirageflow.data.writers import read_parts, write_merged


class MergeRefused(RuntimeError):
    pass


def _merged_schema(shard_dirs: list[Path], fmt: str):
    """One Arrow schema for every shard's Parquet parts, so the merged files agree.

    Each shard infers its own types: a column that is null in all of one shard's rows has
    type null there, and a mix of such files cannot be read back as one dataset.
    """
    if fmt != "parquet":
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    schemas = [pq.read_schema(p) for d in shard_dirs for p in sorted(d.glob("part-*.parquet"))]
    if not schemas:
        return None
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise MergeRefused(
            f"shard outputs have incompatible column types ({e}); "
            "make output_schema produce one type per field or use output_format: jsonl"
        ) from None


def _conform(table, schema):
    import pyarrow as pa

    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def merge_dataset(cfg, ds) -> dict:
    """Write merged/ for dataset ``ds``; refuse (nothing written) when any shard is not complete."""
    missing = []
    for shard_id in range(cfg.num_shards):
        status_path = cfg.shard_dir(shard_id) / "status.json"
        try:
            status = json.loads(status_path.read_text())
        except FileNotFoundError:
            missing.append(shard_id)
            continue
        if status.get("status") != "success" or status.get("num_shards") != cfg.num_shards:
            missing.append(shard_id)
    if missing:
        raise MergeRefused(
            f"cannot merge {ds.path}: shard(s) {missing} of {cfg.num_shards} are not complete "
            f"(no successful {cfg.state_dir}/shard_<id>/status.json); run the workflow until every shard succeeds"
        )

    shard_dirs = [Path(ds.output_dir) / f"shard_{s}" for s in range(cfg.num_shards)]
    schema = _merged_schema(shard_dirs, ds.output_format)

    def tables():
        last = -1
        for d in shard_dirs:
            table = read_parts(d, ds.output_format)
            if table is None:
                continue
            if schema is not None:
                table = _conform(table, schema)
            # Parts hold rows in completion order; a shard's rows are sorted here.
            table = table.sort_by("source_index")
            idx = table.column("source_index").to_pylist()
            if idx[0] <= last or any(b <= a for a, b in zip(idx, idx[1:])):
                raise MergeRefused(f"{d}: a source_index appears twice, or in the wrong shard; the shard outputs were mixed up")
            last = idx[-1]
            yield table

    out = Path(ds.output_dir) / "merged"
    rows = write_merged(tables(), out, ds.output_format)
    return {"dataset": ds.path, "merged_dir": str(out), "rows": rows, "format": ds.output_format}
