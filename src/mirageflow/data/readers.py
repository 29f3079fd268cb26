"""Dataset readers: index a dataset once, then let each shard read only its own rows.

``write_index`` runs in its own Snakemake job (one per dataset). It writes a small JSON
header (row count, files, fingerprint) and, for JSONL, a binary table of where each
shard's rows start (byte offset and line number, 16 bytes per shard). ``load_shard`` reads
the header and its own 16 bytes, so what a shard job reads does not grow with the number
of shards; it then seeks there (JSONL) or to its row groups (Parquet) or slice (Hugging
Face) and reads ``stop - start`` rows. It never parses the rest of the dataset.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections import deque
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from mirageflow.data.sharding import shard_range
from mirageflow.data.writers import atomic_write_bytes, atomic_write_json
from mirageflow.prompts import RowError

INDEX_VERSION = 2
# Per shard in the offsets file: byte offset of its first row, that row's 1-based line number.
SHARD_START = struct.Struct("<QQ")


class SourceRow(NamedTuple):  # a tuple: built once per row, cheaper than a frozen dataclass
    index: int  # position in the dataset (source_index)
    value: Any  # the row mapping, or a RowError for an unreadable row


def _parquet_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True)
    else:
        files = glob.glob(path, recursive=True)
    return sorted(f for f in files if os.path.isfile(f))


def _files(ds) -> list[str]:
    if ds.type == "jsonl":
        return [ds.path]
    if ds.type == "parquet":
        return _parquet_files(ds.path)
    return sorted(str(p) for p in Path(ds.path).rglob("*") if p.is_file())


def fingerprint(ds) -> list[list]:
    """Cheap identity of the dataset's files (path, size, mtime) to detect a changed dataset."""
    out = []
    for f in _files(ds):
        st = os.stat(f)
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


# --------------------------------------------------------------------------- JSONL


def _jsonl_count(path: str) -> int:
    rows = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                rows += 1
    return rows


def _jsonl_starts(path: str, wanted: list[int]) -> dict[int, tuple[int, int]]:
    """Byte offset and 1-based line number of each wanted row (rows are non-blank lines)."""
    todo = deque(sorted(set(wanted)))  # popleft: O(1) per shard start
    found: dict[int, tuple[int, int]] = {}
    row = offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                while todo and todo[0] == row:
                    found[todo.popleft()] = (offset, lineno)
                row += 1
            offset += len(line)
    for r in todo:  # empty shards at the end start at EOF
        found[r] = (offset, 0)
    return found


def _read_jsonl(path: str, start: int, stop: int, offset: int, lineno: int, skip) -> Iterator[SourceRow]:
    index = start
    with open(path, "rb") as f:
        f.seek(offset)
        for lineno, line in enumerate(f, start=lineno):
            if index >= stop:
                return
            if not line.strip():
                continue
            if skip(index):  # committed by an earlier attempt: not even parsed
                index += 1
                continue
            try:
                # str, not bytes: json.loads(bytes) sniffs the encoding of every line; this is
                # its UTF-8 decoding (BOM dropped, surrogatepass) without the sniffing
                value = json.loads(line.decode("utf-8-sig", "surrogatepass"))
                if not isinstance(value, dict):
                    value = RowError("read", "bad_row", f"{path}:{lineno}: line is a JSON {type(value).__name__}, not an object")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                value = RowError("read", "bad_row", f"{path}:{lineno}: not valid JSON ({e})")
            yield SourceRow(index, value)
            index += 1


# --------------------------------------------------------------------------- Parquet


def _read_parquet(files: list[dict], start: int, stop: int) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    base = 0
    for entry in files:
        n = entry["rows"]
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            pf = pq.ParquetFile(entry["path"])
            rg_base = base
            for rg in range(pf.num_row_groups):
                rg_rows = pf.metadata.row_group(rg).num_rows
                a, b = max(lo, rg_base), min(hi, rg_base + rg_rows)
                if a < b:
                    table = pf.read_row_group(rg).slice(a - rg_base, b - a)
                    for i, row in enumerate(table.to_pylist()):
                        yield SourceRow(a + i, row)
                rg_base += rg_rows
        base += n
        if base >= stop:
            return


# --------------------------------------------------------------------------- loadable


def _load_hf(ds):
    import datasets

    obj = datasets.load_from_disk(ds.path)
    if isinstance(obj, datasets.DatasetDict):
        if ds.split is None:
            if len(obj) != 1:
                raise ValueError(f"{ds.path} holds splits {sorted(obj)}; set loading_params.datasets[{ds.index}].split")
            return next(iter(obj.values()))
        if ds.split not in obj:
            raise ValueError(f"{ds.path} has no split '{ds.split}' (has {sorted(obj)})")
        return obj[ds.split]
    return obj


def _read_loadable(ds, start: int, stop: int, chunk: int = 1024) -> Iterator[SourceRow]:
    table = _load_hf(ds)  # memory-mapped Arrow: slicing reads only these rows
    for a in range(start, stop, chunk):
        b = min(stop, a + chunk)
        for i, row in enumerate(table.select(range(a, b)).to_list()):
            yield SourceRow(a + i, row)


# --------------------------------------------------------------------------- public API


class ShardSlice(NamedTuple):
    """Where one shard's rows are: rows [start, stop) of the dataset."""

    start: int
    stop: int
    offset: int = 0  # JSONL: byte offset of row `start`
    line: int = 0  # JSONL: its 1-based line number
    files: list | None = None  # Parquet: [{"path", "rows"}] of the whole dataset


def offsets_path(index_path: str | Path) -> Path:
    """The index's per-shard table, next to it: dataset_K.index.json -> dataset_K.offsets.bin."""
    index_path = Path(index_path)
    return index_path.with_name(index_path.name.removesuffix(".index.json") + ".offsets.bin")


def write_index(ds, num_shards: int, path: str | Path) -> dict:
    """Count the dataset's rows once; write the header to ``path`` and the shard table next to it.

    The table is empty for Parquet and Hugging Face datasets: a shard finds its rows from
    the row count (and the files' row counts) alone. The header is written last, so a
    header always has its table.
    """
    header: dict[str, Any] = {"version": INDEX_VERSION, "path": ds.path, "type": ds.type, "num_shards": num_shards}
    table = b""
    if ds.type == "jsonl":
        rows = _jsonl_count(ds.path)
        starts = [shard_range(rows, num_shards, s)[0] for s in range(num_shards)]
        found = _jsonl_starts(ds.path, starts)
        table = b"".join(SHARD_START.pack(*found[r]) for r in starts)
    elif ds.type == "parquet":
        import pyarrow.parquet as pq

        files = [{"path": f, "rows": pq.ParquetFile(f).metadata.num_rows} for f in _parquet_files(ds.path)]
        if not files:
            raise FileNotFoundError(f"no Parquet files at '{ds.path}'")
        rows = sum(f["rows"] for f in files)
        header["files"] = files
    else:
        rows = len(_load_hf(ds))
    header["rows"] = rows
    header["fingerprint"] = fingerprint(ds)
    atomic_write_bytes(offsets_path(path), table)
    atomic_write_json(path, header)
    return header


def load_shard(path: str | Path, ds, num_shards: int, shard_id: int) -> ShardSlice:
    """This shard's slice, from the index at ``path``: reads the header and 16 bytes of the table."""
    path = Path(path)
    header = json.loads(path.read_text())
    if header.get("version") != INDEX_VERSION or header["num_shards"] != num_shards or header["path"] != ds.path:
        raise ValueError(f"{path} was built for another config or version; rerun its index rule")
    if header["fingerprint"] != fingerprint(ds):
        raise ValueError(
            f"dataset '{ds.path}' changed after it was indexed; rerun so the index rule runs again "
            f"(snakemake --forcerun index_dataset)"
        )
    start, stop = shard_range(header["rows"], num_shards, shard_id)
    if ds.type != "jsonl":
        return ShardSlice(start, stop, files=header.get("files"))
    table = offsets_path(path)
    with open(table, "rb") as f:
        f.seek(shard_id * SHARD_START.size)
        entry = f.read(SHARD_START.size)
    if len(entry) != SHARD_START.size:
        raise ValueError(f"{table} has no entry for shard {shard_id}; rerun the index rule")
    offset, line = SHARD_START.unpack(entry)
    return ShardSlice(start, stop, offset, line)


def read_shard(ds, shard: ShardSlice, skip=lambda i: False) -> Iterator[SourceRow]:
    """Rows of one shard, in source order, each with its source_index; ``skip(i)`` rows are left out."""
    start, stop = shard.start, shard.stop
    if start >= stop:
        return iter(())
    if ds.type == "jsonl":
        return _read_jsonl(ds.path, start, stop, shard.offset, shard.line, skip)
    rows = _read_parquet(shard.files, start, stop) if ds.type == "parquet" else _read_loadable(ds, start, stop)
    return (r for r in rows if not skip(r.index))
