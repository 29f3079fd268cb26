"""Writers: atomic small files, shard part files (temp name, fsync, rename), the merged dataset."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write a whole file so readers see the old content or the new one, never half.

    ``durable``: fsync before the rename, so the new content also survives a crash of the
    machine (not only of the process); off for files that only mark liveness.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj, durable: bool = True, indent: int | None = 2) -> None:
    """``indent=None``: compact, and encoded by json's C encoder (several times faster)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n", durable)


def write_part(path: Path, records: list[dict], fmt: str) -> None:
    """Write records as one Parquet/JSONL file, atomically (temp name, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                table = pa.Table.from_pylist(records)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise ValueError(
                    f"cannot write {path} as Parquet: the records' columns have mixed types ({e}); "
                    "make output_schema produce one type per field or use output_format: jsonl"
                ) from None
            pq.write_table(table, tmp)
        else:
            with open(tmp, "w") as f:
                for r in records:
                    f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_parts(shard_dir: Path, fmt: str):
    """The shard's records as one Arrow table (None when it wrote none)."""
    import pyarrow as pa
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    parts = sorted(Path(shard_dir).glob(f"part-*.{fmt}"))
    tables = [pq.read_table(p) if fmt == "parquet" else pajson.read_json(p) for p in parts]
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="permissive")


def write_merged(tables: Iterable, out_dir: Path, fmt: str) -> int:
    """Write tables (in order) as merged/part-NNNNN files, replacing the old merged dir atomically."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    rows = 0
    try:
        for i, table in enumerate(tables):
            path = tmp / f"part-{i:05d}.{fmt}"
            if fmt == "parquet":
                pq.write_table(table, path)
            else:
                with open(path, "w") as f:
                    for r in table.to_pylist():
                        f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
            rows += table.num_rows
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rows
