"""Dataset readers: index a dataset once, then let each shard read only its own rows.

``write_index`` runs in its own Snakemake job (one per dataset). It writes a small JSON
header (row count, files, fingerprint) and, for JSONL, a binary table of where each
shard's rows start (byte offset and line number, 16 bytes per shard). ``load_shard`` reads
the header and its own 16 bytes, so what a shard job reads does not grow with the number
of shards; it then seeks there (JSONL) or to its row groups (Parquet) or slice (Hugging
Face) and reads ``stop - start`` rows. It never parses the rest of the dataset.

What a shard reader promises (the runner checks it): for the shard's rows [start, stop)
it yields exactly one ``SourceRow`` per index, in order, leaving out only the rows
``skip(index)`` names; each value is the row (a dict) or a ``RowError`` saying why that
row cannot be read. A failure that is not one row's (a file that cannot be opened or has
fewer rows than indexed) raises ``DatasetReadError``, naming the file.

Row values are plain Python: what ``json.loads`` gives (JSONL) or Arrow's ``to_pylist``
(Parquet, Hugging Face), except that an Arrow MAP value becomes a dict when its keys are
all strings and distinct, and otherwise a list of ``[key, value]`` pairs (in order, so no
key or value is lost).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import struct
from collections import deque
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from mirageflow.config.types import DatasetConfig
from mirageflow.data.sharding import shard_range
from mirageflow.files import ContentCache, atomic_write_bytes, atomic_write_json, digest_of, open_regular, stat_key
from mirageflow.errors import MirageflowError, RowError, RowErrorClass as E

INDEX_VERSION = 3
# Per shard in the offsets file: byte offset of its first row, that row's 1-based line number.
SHARD_START = struct.Struct("<QQ")


class DatasetReadError(MirageflowError, OSError):
    """A dataset file cannot be read (not one row of it): the shard cannot go on. Names the file."""


class DatasetEndedEarly(DatasetReadError):
    """A dataset file has fewer rows than the slice asked for (changed after it was indexed)."""


class SourceRow(NamedTuple):  # a tuple: built once per row, cheaper than a frozen dataclass
    index: int  # position in the dataset (source_index)
    value: Any  # the row mapping, or a RowError for an unreadable row


def parquet_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True)
    else:
        files = glob.glob(path, recursive=True)
    return sorted(f for f in files if os.path.isfile(f))


def dataset_files(ds: DatasetConfig) -> list[str]:
    """The files dataset ``ds`` is read from (Snakemake's inputs of its index rule)."""
    if ds.type == "jsonl":
        return [ds.path]
    if ds.type == "parquet":
        return parquet_files(ds.path)
    return sorted(str(p) for p in Path(ds.path).rglob("*") if p.is_file())


# Snakemake does not rerun a job whose newer input has the same checksum as before (files up
# to --max-checksum-file-size, 1 MB by default): such a rewritten dataset file keeps its old
# index, so files up to this size are also identified by their content.
CONTENT_HASHED_MAX_BYTES = 16 << 20


def _sha256(path: str) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fingerprint(ds: DatasetConfig, hashed: bool = True) -> list[list]:
    """Identity of the dataset's files: [path, size, mtime_ns, sha256 or None (large files)]."""
    out = []
    for f in dataset_files(ds):
        st = os.stat(f)
        digest = _sha256(f) if hashed and st.st_size <= CONTENT_HASHED_MAX_BYTES else None
        out.append([f, st.st_size, st.st_mtime_ns, digest])
    return out


def file_contents(ds: DatasetConfig) -> dict[str, list]:
    """Each dataset file's stat identity and SHA-256 of its bytes: {path: [[dev, inode, size,
    mtime_ns, ctime_ns], sha256]} (the index keeps it; mirageflow.state.inputs compares it
    with the files at DAG build, so an edit is seen whatever its mtime)."""
    out = {}
    for f in dataset_files(ds):
        with open_regular(f) as fh:
            key = stat_key(os.fstat(fh.fileno()))
            out[f] = [key, hashlib.file_digest(fh, "sha256").hexdigest()]
    return out


def content_digest(header: dict) -> str | None:
    """The digest of an index's recorded file contents (None for an index without them)."""
    content = header.get("content")
    if not isinstance(content, dict):
        return None
    return digest_of({p: v[1] if isinstance(v, list) and len(v) == 2 else None for p, v in content.items()})


def _content_unchanged(content: dict, ds: DatasetConfig, cache_path: str | os.PathLike | None) -> bool:
    """The files are those indexed, by content: same paths, and for each file the same stat
    identity (inode, size, mtime, ctime) or, where it moved, the same SHA-256 (the driver's
    content cache at ``cache_path`` spares the hash of a file it already hashed)."""
    files = dataset_files(ds)
    if sorted(files) != sorted(content):
        return False
    cache = ContentCache(cache_path)
    for f in files:
        key, sha = content[f]
        if cache.digest(f, (key, sha)) != sha:
            return False
    return True


def unchanged_since_indexed(indexed: list[list], ds: DatasetConfig, content: dict | None = None, cache_path=None) -> bool:
    """The files are those indexed: with ``content`` (the index's file contents) the same
    bytes whatever the mtimes say; else (an index from before content hashes) same paths,
    sizes and mtimes, or, where only an mtime moved, the same content (a file rewritten
    with identical bytes)."""
    if isinstance(content, dict):
        return _content_unchanged(content, ds, cache_path)
    now = fingerprint(ds, hashed=False)
    if [e[:3] for e in indexed] == now:
        return True
    if [e[:2] for e in indexed] != [e[:2] for e in now]:
        return False
    return all(old[2] == new[2] or (old[3] is not None and old[3] == _sha256(new[0])) for old, new in zip(indexed, now))


# --------------------------------------------------------------------------- JSONL


def jsonl_count(path: str) -> int:
    rows = 0
    with open_regular(path) as f:
        for line in f:
            if line.strip():
                rows += 1
    return rows


def _jsonl_starts(path: str, wanted: list[int]) -> dict[int, tuple[int, int]]:
    """Byte offset and 1-based line number of each wanted row (rows are non-blank lines)."""
    todo = deque(sorted(set(wanted)))  # popleft: O(1) per shard start
    found: dict[int, tuple[int, int]] = {}
    row = offset = 0
    with open_regular(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                while todo and todo[0] == row:
                    found[todo.popleft()] = (offset, lineno)
                row += 1
            offset += len(line)
    for r in todo:  # empty shards at the end start at EOF
        found[r] = (offset, 0)
    return found


# Lone surrogates (U+D800..U+DFFF alone) pass json.loads but no UTF-8 encoder: they would
# kill the shard later (tokenizer, writers), so such a row is a row error at read time.
_SURROGATE = re.compile("[\ud800-\udfff]")
_UD_ESCAPE = re.compile(rb"\\u[dD]")  # where json.loads can make one: a \uDxxx escape


def _printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` (safe in UTF-8 messages)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_at(value) -> str | None:
    """Where the first lone surrogate in ``value`` is (a key path such as ``a.b[2]``), or None."""
    stack = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return where or "(the value)"
        elif isinstance(v, dict):
            for k, x in v.items():
                path = f"{where}.{_printable(k)}" if where else _printable(k)
                if _SURROGATE.search(k):
                    return f"key {path}"
                stack.append((x, path))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return None


def _jsonl_row(line: bytes, path: str, lineno: int):
    """One JSONL line as a dict, or the RowError saying why it is not one (never raises)."""
    try:
        # str, not bytes: json.loads(bytes) sniffs the encoding of every line; this is its
        # UTF-8 decoding (BOM dropped) without the sniffing, strict: encoded surrogates fail
        text = line.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        try:
            line.decode("utf-8-sig", "surrogatepass")
        except UnicodeDecodeError:
            return RowError("read", E.BAD_ROW, f"{path}:{lineno}: not valid UTF-8 ({e})")
        return RowError("read", E.INVALID_UNICODE, f"{path}:{lineno}: a lone UTF-16 surrogate encoded as UTF-8 bytes ({e})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return RowError("read", E.BAD_ROW, f"{path}:{lineno}: not valid JSON ({e})")
    except Exception as e:  # RecursionError (deep nesting), MemoryError, ...: this row only
        return RowError("read", E.BAD_ROW, f"{path}:{lineno}: cannot parse this line ({type(e).__name__}: {e})")
    if type(value) is not dict:
        return RowError("read", E.BAD_ROW, f"{path}:{lineno}: line is a JSON {type(value).__name__}, not an object")
    # Only a line with a \\uD... escape can hold a lone surrogate now (the strict decoding
    # refused encoded ones): the common path pays a search of the line, not a walk of the value.
    if _UD_ESCAPE.search(line):
        try:
            where = lone_surrogate_at(value)
        except Exception as e:  # defensive: a row, never the shard
            return RowError("read", E.BAD_ROW, f"{path}:{lineno}: cannot check this row ({type(e).__name__}: {e})")
        if where is not None:
            return RowError(
                "read", E.INVALID_UNICODE, f"{path}:{lineno}: {where} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape)"
            )
    return value


def _read_jsonl(path: str, start: int, stop: int, offset: int, lineno: int, skip) -> Iterator[SourceRow]:
    index = start
    loads = json.loads
    try:
        f = open_regular(path)
    except (OSError, ValueError) as e:
        raise DatasetReadError(f"{path}: cannot open the dataset file ({e})") from e
    with f:
        try:
            f.seek(offset)
            for lineno, line in enumerate(f, start=lineno):
                if index >= stop:
                    return
                if not line.strip():
                    continue
                if skip(index):  # committed by an earlier attempt: not even parsed
                    index += 1
                    continue
                # The common path, inline; anything unusual is redone and named by _jsonl_row.
                try:
                    value = loads(line.decode("utf-8-sig"))
                except Exception:
                    value = _jsonl_row(line, path, lineno)
                else:
                    # 92 is "\\": memchr, nearly free; only then look for a \\uD escape
                    if type(value) is not dict or (92 in line and _UD_ESCAPE.search(line)):
                        value = _jsonl_row(line, path, lineno)
                yield SourceRow(index, value)
                index += 1
        except OSError as e:
            raise DatasetReadError(f"{path}: cannot read past line {lineno} ({e})") from e
    if index < stop:
        raise DatasetEndedEarly(
            f"{path}: ended at row {index}, but its index says the shard has rows up to {stop - 1}; "
            "the file changed after it was indexed: rerun so the index rule runs again"
        )


# --------------------------------------------------------------------------- Parquet


def _map_converter(t):
    """A function giving mirageflow's form of a ``to_pylist`` value of Arrow type ``t``; None when
    ``t`` holds no MAP (the value is kept as it is).

    ``to_pylist`` gives a MAP as a list of (key, value) tuples. It becomes a dict when every
    key is a str and no key repeats, else a list of [key, value] lists: lossless either way.
    """
    import pyarrow as pa

    if pa.types.is_map(t):
        key, item = _map_converter(t.key_type), _map_converter(t.item_type)

        def convert_map(v):
            if v is None:
                return None
            pairs = [(key(k) if key else k, item(x) if item else x) for k, x in v]
            if all(type(k) is str for k, _ in pairs):
                d = dict(pairs)
                if len(d) == len(pairs):
                    return d
            return [[k, x] for k, x in pairs]

        return convert_map
    if (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or (hasattr(pa.types, "is_list_view") and (pa.types.is_list_view(t) or pa.types.is_large_list_view(t)))
    ):
        inner = _map_converter(t.value_type)
        if inner is None:
            return None
        return lambda v: None if v is None else [inner(x) for x in v]
    if pa.types.is_struct(t):
        fields = {t.field(i).name: c for i in range(t.num_fields) if (c := _map_converter(t.field(i).type))}
        if not fields:
            return None

        def convert_struct(v):
            if v is None:
                return None
            for name, c in fields.items():
                v[name] = c(v[name])
            return v

        return convert_struct
    return None


def arrow_rows(table, where: str, first: int) -> list:
    """``table``'s rows as dicts (MAPs converted); a row that cannot be converted (e.g. a
    timestamp beyond Python's datetime) is a RowError, the others are kept. ``first``: the
    dataset index of its first row, for messages."""
    converters = {f.name: c for f in table.schema if (c := _map_converter(f.type))}
    try:
        rows = table.to_pylist()
    except Exception:
        rows = []
        for i in range(table.num_rows):
            try:
                rows.extend(table.slice(i, 1).to_pylist())
            except Exception as e:
                rows.append(RowError("read", E.BAD_ROW, f"{where}: row {first + i} cannot be converted ({type(e).__name__}: {e})"))
    if converters:
        for i, row in enumerate(rows):
            if isinstance(row, RowError):
                continue
            try:
                for name, c in converters.items():
                    row[name] = c(row[name])
            except Exception as e:
                rows[i] = RowError("read", E.BAD_ROW, f"{where}: row {first + i} cannot be converted ({type(e).__name__}: {e})")
    return rows


def _open_parquet(path: str, rows: int):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        found = pf.metadata.num_rows
    except Exception as e:
        raise DatasetReadError(
            f"{path}: cannot read this Parquet file's footer ({type(e).__name__}: {e}); replace the file, then rerun"
        ) from e
    if found != rows:
        raise DatasetReadError(
            f"{path}: has {found} rows, its index says {rows}; the file changed after it was indexed: rerun so the index rule runs again"
        )
    return pf


def _parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DatasetReadError(
            f"{path}: cannot read this Parquet file's footer ({type(e).__name__}: {e}); replace the file, then rerun"
        ) from e


def _read_parquet(files: list[dict], start: int, stop: int, skip) -> Iterator[SourceRow]:
    base = 0
    for entry in files:
        n = entry["rows"]
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            path = entry["path"]
            pf = _open_parquet(path, n)
            rg_base = base
            for rg in range(pf.num_row_groups):
                rg_rows = pf.metadata.row_group(rg).num_rows
                a, b = max(lo, rg_base), min(hi, rg_base + rg_rows)
                if a < b and not all(skip(i) for i in range(a, b)):  # all committed: not even read
                    try:
                        table = pf.read_row_group(rg)
                        if table.num_rows != rg_rows:
                            raise ValueError(f"it has {table.num_rows} rows, the footer says {rg_rows}")
                    except Exception as e:
                        # One damaged row group costs its rows, not the file's other groups.
                        why = (
                            f"{path}: row group {rg} (dataset rows {rg_base}..{rg_base + rg_rows - 1}) "
                            f"cannot be read ({type(e).__name__}: {e})"
                        )
                        for i in range(a, b):
                            if not skip(i):
                                yield SourceRow(i, RowError("read", E.UNREADABLE_ROW_GROUP, why))
                    else:
                        rows = arrow_rows(table.slice(a - rg_base, b - a), f"{path}", a)
                        for i, row in enumerate(rows, start=a):
                            if not skip(i):
                                yield SourceRow(i, row)
                rg_base += rg_rows
        base += n
        if base >= stop:
            return


# --------------------------------------------------------------------------- loadable


def load_hf(ds: DatasetConfig):
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


def _read_loadable(ds: DatasetConfig, start: int, stop: int, skip, chunk: int = 1024) -> Iterator[SourceRow]:
    try:
        table = load_hf(ds)  # memory-mapped Arrow: slicing reads only these rows
        rows = len(table)
    except Exception as e:
        raise DatasetReadError(f"{ds.path}: cannot load this dataset ({type(e).__name__}: {e})") from e
    if rows < stop:
        raise DatasetReadError(
            f"{ds.path}: has {rows} rows, its index says the shard has rows up to {stop - 1}; "
            "the dataset changed after it was indexed: rerun so the index rule runs again"
        )
    for a in range(start, stop, chunk):
        b = min(stop, a + chunk)
        if all(skip(i) for i in range(a, b)):
            continue
        try:
            values = table.select(range(a, b)).to_list()
            if len(values) != b - a:
                raise ValueError(f"got {len(values)} rows for {b - a}")
        except Exception:
            values = []  # one row at a time: keep every row that can be read
            for i in range(a, b):
                try:
                    values.append(table[i])
                except Exception as e:
                    values.append(RowError("read", E.UNREADABLE_ROWS, f"{ds.path}: row {i} cannot be read ({type(e).__name__}: {e})"))
        for i, row in enumerate(values, start=a):
            if not skip(i):
                yield SourceRow(i, row)


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


def write_index(ds: DatasetConfig, num_shards: int, path: str | Path) -> dict:
    """Count the dataset's rows once; write the header to ``path`` and the shard table next to it.

    The table is empty for Parquet and Hugging Face datasets: a shard finds its rows from
    the row count (and the files' row counts) alone. The header is written last, so a
    header always has its table.
    """
    header: dict[str, Any] = {"version": INDEX_VERSION, "path": ds.path, "type": ds.type, "num_shards": num_shards}
    table = b""
    if ds.type == "jsonl":
        rows = jsonl_count(ds.path)
        starts = [shard_range(rows, num_shards, s)[0] for s in range(num_shards)]
        found = _jsonl_starts(ds.path, starts)
        table = b"".join(SHARD_START.pack(*found[r]) for r in starts)
    elif ds.type == "parquet":
        files = [{"path": f, "rows": _parquet_rows(f)} for f in parquet_files(ds.path)]
        if not files:
            raise FileNotFoundError(f"no Parquet files at '{ds.path}'")
        rows = sum(f["rows"] for f in files)
        header["files"] = files
    else:
        rows = len(load_hf(ds))
    header["rows"] = rows
    header["fingerprint"] = fingerprint(ds)
    header["content"] = file_contents(ds)
    atomic_write_bytes(offsets_path(path), table)
    atomic_write_json(path, header)
    return header


def load_shard(path: str | Path, ds: DatasetConfig, num_shards: int, shard_id: int) -> ShardSlice:
    """This shard's slice, from the index at ``path``: reads the header and 16 bytes of the table."""
    path = Path(path)
    header = json.loads(path.read_text())
    if header.get("version") != INDEX_VERSION or header["num_shards"] != num_shards or header["path"] != ds.path:
        raise ValueError(f"{path} was built for another config or version; rerun its index rule")
    if not unchanged_since_indexed(header["fingerprint"], ds, header.get("content"), path.parent / "content.json"):
        raise ValueError(
            f"dataset '{ds.path}' changed after it was indexed; rerun so the index rule runs again (snakemake --forcerun index_dataset)"
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


def read_shard(ds: DatasetConfig, shard: ShardSlice, skip=lambda i: False) -> Iterator[SourceRow]:
    """Rows of one shard, in source order, each with its source_index; ``skip(i)`` rows are left out.

    Exactly one SourceRow per other index of [start, stop): a dict, or a RowError for a row
    that cannot be read. Raises DatasetReadError (an OSError naming the file) when the data
    cannot be read at all.
    """
    start, stop = shard.start, shard.stop
    if start >= stop:
        return iter(())
    if ds.type == "jsonl":
        return _read_jsonl(ds.path, start, stop, shard.offset, shard.line, skip)
    if ds.type == "parquet":
        return _read_parquet(shard.files, start, stop, skip)
    return _read_loadable(ds, start, stop, skip)
