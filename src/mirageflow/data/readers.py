"""Dataset readers: index a dataset once, then let each shard read only its own rows.

``write_index`` runs in its own Snakemake job (one per dataset) and reads each file once
(a Parquet file's footer only). It writes a small JSON header (row count, files, each
file's stat and content identity) and, for JSONL, a binary table of where each shard's
rows start (byte offset and line number, 16 bytes per shard). ``load_shard`` reads the
header and its own 16 bytes, so what a shard job reads does not grow with the number of
shards, and checks the files against the recorded identities without hashing them; it
then seeks there (JSONL) or streams its part of its row groups in batches, only the
columns the pipeline reads (Parquet), or slices (Hugging Face), and reads ``stop - start``
rows. It never parses the rest of the dataset. docs/data.md says what each step reads.

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
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from mirageflow.config.types import DatasetConfig
from mirageflow.data.sharding import row_group_starts, shard_range
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

# A Parquet file's content identity is made from its size and its footer, not every byte
# (docs/data.md, "Content identity"): what it starts with says so, and it never equals a SHA-256.
PARQUET_FOOTER_IDENTITY = "parquet-footer-sha256:"
_PARQUET_MAGIC = (b"PAR1", b"PARE")  # PARE: a footer encrypted with its own key


def parquet_footer_identity(path: str, f=None) -> str:
    """A Parquet file's content identity from what does not need every byte: the SHA-256 of
    its size, its footer (the Thrift FileMetaData: schema, every row group's row count and
    every column chunk's byte offsets, compressed and uncompressed sizes, encodings and
    min/max/null statistics) and the footer's length and magic. Reads the last bytes only.
    ``f``: the file, already open (binary)."""
    own = f is None
    if own:
        f = open_regular(path)
    try:
        size = os.fstat(f.fileno()).st_size
        if size < 12:
            raise ValueError(f"{path}: {size} bytes is too small for a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] not in _PARQUET_MAGIC or length > size - 12:
            raise ValueError(f"{path}: not a Parquet file (no footer magic at its end)")
        f.seek(size - 8 - length)
        footer = f.read(length)
    finally:
        if own:
            f.close()
    h = hashlib.sha256(size.to_bytes(8, "little"))
    h.update(footer)
    h.update(tail)
    return PARQUET_FOOTER_IDENTITY + h.hexdigest()


def identify_function(ds: DatasetConfig):
    """How the content of ``ds``'s files is identified: the footer identity (Parquet) or the
    SHA-256 of every byte (JSONL, a Hugging Face dataset's Arrow files)."""
    return parquet_footer_identity if ds.type == "parquet" else _sha256


def _sha256(path: str) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fingerprint_entry(path: str, key: list[int], identity: str) -> list:
    """[path, size, mtime_ns, identity or None (large files)]: the index's older file list."""
    return [path, key[1], key[2], identity if key[1] <= CONTENT_HASHED_MAX_BYTES else None]


def content_digest(header: dict) -> str | None:
    """The digest of an index's recorded file contents (None for an index without them)."""
    content = header.get("content")
    if not isinstance(content, dict):
        return None
    return digest_of({p: v[1] if isinstance(v, list) and len(v) == 2 else None for p, v in content.items()})


def recorded_content_stale(content: dict, ds: DatasetConfig, cache_path: str | os.PathLike | None) -> str | None:
    """Why the dataset's files may not be those indexed (None: they are), without hashing a
    whole file: what a shard job checks (docs/data.md, "Content identity").

    A file whose stat identity (inode, size, mtime, ctime) is the one the index recorded, or
    one the driver's content cache at ``cache_path`` recorded with the same identity, is
    trusted. A Parquet file is checked by its footer identity (its last bytes). Any other
    file changed on disk after the driver last checked it: the job refuses to read it; the
    next run's driver identifies it once (same bytes: the index and the shards' work are kept).
    """
    files = dataset_files(ds)
    if sorted(files) != sorted(content):
        return "its files are not those indexed (added or removed)"
    cache = ContentCache(cache_path)  # the driver's: read only
    cheap = ds.type == "parquet"
    for f in files:
        known = content[f]
        try:
            key = stat_key(os.stat(f))
            identity = cache.recorded(f, key, (known[0], known[1]))
            if identity is None and cheap:
                identity = parquet_footer_identity(f)
        except (OSError, ValueError) as e:
            return f"{f} cannot be read ({type(e).__name__}: {e})"
        if identity is None:
            return (
                f"{f} changed on disk (inode, size, mtime or ctime) after the workflow's driver last checked its content; "
                "a shard job does not hash a dataset file: run the workflow again, its driver identifies the file once "
                "(the same bytes keep the index and every shard's work)"
            )
        if identity != known[1]:
            return f"{f} changed since it was indexed (by content, whatever its mtime)"
    return None


def unchanged_since_indexed(indexed: list[list], ds: DatasetConfig, content: dict | None = None, cache_path=None) -> bool:
    """The files are those indexed (never hashing a whole file): with ``content`` (the
    index's file identities) as ``recorded_content_stale`` says; else (an index from before
    content identities) the same paths, sizes and mtimes."""
    if isinstance(content, dict):
        return recorded_content_stale(content, ds, cache_path) is None
    now = [[f, *stat_key(os.stat(f))[1:3]] for f in dataset_files(ds)]
    return [e[:3] for e in indexed] == now


# --------------------------------------------------------------------------- JSONL


def jsonl_count(path: str) -> int:
    rows = 0
    with open_regular(path) as f:
        for line in f:
            if line.strip():
                rows += 1
    return rows


class _RowMarks:
    """Byte offset and 1-based line number of every ``step``-th row, in bounded memory: when
    ``cap`` marks are held, every other one is dropped and ``step`` doubles."""

    def __init__(self, cap: int):
        from array import array

        self.cap, self.step, self.next = cap, 1, 0
        self.offsets, self.lines = array("q"), array("q")

    def add(self, row: int, offset: int, lineno: int) -> None:
        self.offsets.append(offset)
        self.lines.append(lineno)
        if len(self.offsets) >= self.cap:
            self.offsets, self.lines = self.offsets[::2], self.lines[::2]
            self.step *= 2
        self.next = row + self.step - row % self.step if row % self.step else row + self.step


_INDEX_CHUNK = 1 << 20


def index_jsonl(path: str, num_shards: int) -> tuple[int, bytes, list]:
    """One pass over a JSONL file: its row count (rows are non-blank lines), each shard's
    start (byte offset, 1-based line number; EOF and 0 for an empty shard at the end) packed
    as the index's table, and its content identity [stat identity, SHA-256].

    The pass keeps every ``step``-th row's start in bounded memory (at least 64 marks a
    shard); a shard's exact start is then found reading forward from the mark before it, in
    the same open file: at most ``step`` rows a shard, 1/64 of the file in all."""
    marks = _RowMarks(max(1 << 16, 64 * num_shards))
    h = hashlib.sha256()
    row = offset = lineno = size = 0
    tail = b""
    with open_regular(path) as f:
        key = stat_key(os.fstat(f.fileno()))
        while True:
            chunk = f.read(_INDEX_CHUNK)
            h.update(chunk)
            size += len(chunk)
            if chunk:
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
            else:  # EOF: a last line without its newline
                lines, tail = ([tail] if tail else []), b""
            for line in lines:
                lineno += 1
                if line and not line.isspace():  # line.strip(), without the copy
                    if row == marks.next:
                        marks.add(row, offset, lineno)
                    row += 1
                offset += len(line) + 1
            if not chunk:
                break
        starts = [shard_range(row, num_shards, s)[0] for s in range(num_shards)]
        table = b"".join(SHARD_START.pack(*_row_start(f, path, marks, r, row, size)) for r in starts)
    return row, table, [key, h.hexdigest()]


def _row_start(f, path: str, marks: _RowMarks, wanted: int, rows: int, end: int) -> tuple[int, int]:
    """(byte offset, 1-based line number) of row ``wanted``: read forward from the mark before it."""
    if wanted >= rows:  # empty shards at the end start at EOF
        return end, 0
    m = wanted // marks.step
    offset, lineno, row = marks.offsets[m], marks.lines[m], m * marks.step
    if row == wanted:  # a mark is a row's start
        return offset, lineno
    f.seek(offset)
    for line in f:
        if line.strip():
            if row == wanted:
                return offset, lineno
            row += 1
        offset += len(line)
        lineno += 1
    raise DatasetEndedEarly(f"{path}: ended before row {wanted} while it was being indexed (the file changed meanwhile)")


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
                    # "utf-8-sig" decoding: the C codec, then the BOM dropped here (the
                    # "utf-8-sig" codec itself is Python code, ~3 us of a row's ~50)
                    text = line.decode()
                    value = loads(text[1:] if text[0] == "\ufeff" else text)
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
        pf = pq.ParquetFile(path, buffer_size=PARQUET_READ_BUFFER, pre_buffer=False)
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


def _index_parquet_file(path: str) -> tuple[int, list, list[int]]:
    """A Parquet file's row count, [stat identity, footer identity] and its row groups' row
    counts, from its footer alone."""
    import pyarrow.parquet as pq

    try:
        with open_regular(path) as f:
            key = stat_key(os.fstat(f.fileno()))
            identity = parquet_footer_identity(path, f)
            f.seek(0)
            meta = pq.ParquetFile(f).metadata
            rows, groups = meta.num_rows, [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    except Exception as e:
        raise DatasetReadError(
            f"{path}: cannot read this Parquet file's footer ({type(e).__name__}: {e}); replace the file, then rerun"
        ) from e
    return rows, [key, identity], groups


# Rows decoded at a time from a Parquet row group, and the read buffer of a column chunk:
# without one (and with pre_buffer, on by default) Arrow reads whole column chunks into memory
# (hundreds of MB in a one-row-group file).
PARQUET_BATCH_ROWS = 1024
PARQUET_READ_BUFFER = 1 << 20


def parquet_columns(schema_names: list[str], columns: frozenset[str] | None) -> list[str] | None:
    """The file's columns to read for the pipeline's ``columns`` (None: all of them), in the file's order."""
    if columns is None or any("." in name for name in schema_names):  # a dotted name would select a nested field
        return None
    wanted = [name for name in schema_names if name in columns]
    return wanted or schema_names[:1]  # at least one column: it carries the row count


def _read_parquet(files: list[dict], start: int, stop: int, skip, columns: frozenset[str] | None = None) -> Iterator[SourceRow]:
    base = 0
    for entry in files:
        n = entry["rows"]
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            path = entry["path"]
            pf = _open_parquet(path, n)
            names = parquet_columns(pf.schema_arrow.names, columns)
            rg_base = base
            for rg in range(pf.num_row_groups):
                rg_rows = pf.metadata.row_group(rg).num_rows
                a, b = max(lo, rg_base), min(hi, rg_base + rg_rows)
                if a < b and not all(skip(i) for i in range(a, b)):  # all committed: not even read
                    yield from _read_row_group_rows(pf, path, rg, rg_base, rg_rows, a, b, names, skip)
                rg_base += rg_rows
                if rg_base >= hi:
                    break
        base += n
        if base >= stop:
            return


def _read_row_group_rows(pf, path: str, rg: int, rg_base: int, rg_rows: int, a: int, b: int, names, skip) -> Iterator[SourceRow]:
    """Rows [a, b) of row group ``rg`` (its first row is dataset row ``rg_base``): streamed in
    batches of PARQUET_BATCH_ROWS, the batches before ``a`` dropped as they come, nothing read
    past ``b``. Rows the group cannot give are RowErrors; the rows before them are kept."""
    at = rg_base  # dataset index of the next row the stream gives
    given = a  # rows before it were yielded (or skipped)
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[rg], columns=names, use_threads=False)
    try:
        while at < b:
            try:
                batch = next(batches, None)
                if batch is None:
                    raise ValueError(f"it ended after {at - rg_base} rows, the footer says {rg_rows}")
                first, count = at, batch.num_rows
                at += count
                if at <= a:
                    continue
                lo = max(a - first, 0)
                rows = arrow_rows(batch.slice(lo, min(b - first, count) - lo), path, first + lo)
            except Exception as e:
                # A damaged group costs its rows from the damage on, not the file's other groups.
                why = f"{path}: row group {rg} (dataset rows {rg_base}..{rg_base + rg_rows - 1}) cannot be read ({type(e).__name__}: {e})"
                for i in range(given, b):
                    if not skip(i):
                        yield SourceRow(i, RowError("read", E.UNREADABLE_ROW_GROUP, why))
                return
            for i, row in enumerate(rows, start=first + lo):
                given = i + 1
                if not skip(i):
                    yield SourceRow(i, row)
    finally:
        batches.close()


# A row group this many times a shard's rows, and this large, gets a warning from `mmirage check`.
ROW_GROUP_WARN_RATIO = 8
ROW_GROUP_WARN_BYTES = 16 << 20


def row_group_warnings(ds: DatasetConfig, num_shards: int) -> list[str]:
    """`mmirage check`'s warnings about Parquet files whose row groups are far larger than a
    shard (from their footers): a shard streams its row group from the group's first row up
    to its own last one, so the late shards of a big group read most of it."""
    import pyarrow.parquet as pq

    files = [(f, pq.ParquetFile(f).metadata) for f in parquet_files(ds.path)]
    shard_rows = max(1, -(-sum(m.num_rows for _, m in files) // num_shards))
    out = []
    for f, meta in files:
        groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
        big = max(groups, key=lambda g: g.num_rows, default=None)
        if big is None or big.num_rows <= ROW_GROUP_WARN_RATIO * shard_rows or big.total_byte_size <= ROW_GROUP_WARN_BYTES:
            continue
        out.append(
            f"{ds.key}: {f} has row groups of up to {big.num_rows:,} rows ({big.total_byte_size / 1e6:,.0f} MB decoded), "
            f"{big.num_rows // shard_rows:,}x a shard's {shard_rows:,} rows: a shard reads its group from the group's start "
            f"up to its own rows, so late shards read most of it. Rewrite it with smaller row groups: "
            f"python -c \"import pyarrow.parquet as pq; pq.write_table(pq.read_table('{f}'), '{f}.new', row_group_size={shard_rows})\" "
            f"&& mv '{f}.new' '{f}'"
        )
    return out


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


def _read_loadable(
    ds: DatasetConfig, start: int, stop: int, skip, columns: frozenset[str] | None = None, chunk: int = 1024
) -> Iterator[SourceRow]:
    try:
        table = load_hf(ds)  # memory-mapped Arrow: slicing reads only these rows (and columns)
        rows = len(table)
        names = parquet_columns(list(table.column_names), columns)
        if names is not None and len(names) < len(table.column_names):
            table = table.select_columns(names)
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

    Each file is read once: a JSONL file in one pass (rows, shard starts, SHA-256), a Parquet
    file's footer only (rows, footer identity), a Hugging Face dataset's files hashed once.

    The table is empty for Parquet and Hugging Face datasets: a shard finds its rows from
    the row count (and the files' row counts) alone. The header is written last, so a
    header always has its table.
    """
    header: dict[str, Any] = {"version": INDEX_VERSION, "path": ds.path, "type": ds.type, "num_shards": num_shards}
    table = b""
    content: dict[str, list] = {}  # path -> [stat identity, content identity], each file read once
    if ds.type == "jsonl":
        rows, table, content[ds.path] = index_jsonl(ds.path, num_shards)
    elif ds.type == "parquet":
        files, groups = [], []
        for f in parquet_files(ds.path):
            n, content[f], file_groups = _index_parquet_file(f)
            files.append({"path": f, "rows": n})
            groups += file_groups
        if not files:
            raise FileNotFoundError(f"no Parquet files at '{ds.path}'")
        rows = sum(f["rows"] for f in files)
        header["files"] = files
        if ds.shard_boundaries == "row_groups":  # each shard's first row, in the table (16 bytes a shard)
            header["shard_boundaries"] = "row_groups"
            table = b"".join(SHARD_START.pack(start, 0) for start in row_group_starts(groups, num_shards))
    else:
        rows = len(load_hf(ds))  # memory-mapped: the length reads no rows
        for f in dataset_files(ds):
            with open_regular(f) as fh:
                content[f] = [stat_key(os.fstat(fh.fileno())), hashlib.file_digest(fh, "sha256").hexdigest()]
    header["rows"] = rows
    header["fingerprint"] = [_fingerprint_entry(f, key, identity) for f, (key, identity) in content.items()]
    header["content"] = content
    atomic_write_bytes(offsets_path(path), table)
    atomic_write_json(path, header)
    return header


def load_shard(path: str | Path, ds: DatasetConfig, num_shards: int, shard_id: int) -> ShardSlice:
    """This shard's slice, from the index at ``path``: reads the header and 16 bytes of the table."""
    path = Path(path)
    header = json.loads(path.read_text())
    if header.get("version") != INDEX_VERSION or header["num_shards"] != num_shards or header["path"] != ds.path:
        raise ValueError(f"{path} was built for another config or version; rerun its index rule")
    content = header.get("content")
    if isinstance(content, dict):  # trusted as recorded by the index or the driver: never a whole-file hash here
        stale = recorded_content_stale(content, ds, path.parent / "content.json")
        if stale is not None:
            raise ValueError(f"dataset '{ds.path}' changed after it was indexed: {stale}")
    elif not unchanged_since_indexed(header["fingerprint"], ds):
        raise ValueError(
            f"dataset '{ds.path}' changed after it was indexed; rerun so the index rule runs again (snakemake --forcerun index_dataset)"
        )
    if header.get("shard_boundaries", "rows") != ds.shard_boundaries:
        raise ValueError(f"{path} was built for shard_boundaries: {header.get('shard_boundaries', 'rows')}; rerun its index rule")
    if ds.shard_boundaries == "row_groups":
        start, stop = _table_entry(path, shard_id)[0], header["rows"]
        if shard_id + 1 < num_shards:
            stop = _table_entry(path, shard_id + 1)[0]
        return ShardSlice(start, stop, files=header.get("files"))
    start, stop = shard_range(header["rows"], num_shards, shard_id)
    if ds.type != "jsonl":
        return ShardSlice(start, stop, files=header.get("files"))
    offset, line = _table_entry(path, shard_id)
    return ShardSlice(start, stop, offset, line)


def _table_entry(path: Path, shard_id: int) -> tuple[int, int]:
    """Shard ``shard_id``'s entry of the index's table: (byte offset, line) of a JSONL shard's
    first row, (first row, 0) of a Parquet shard on row-group boundaries."""
    table = offsets_path(path)
    with open(table, "rb") as f:
        f.seek(shard_id * SHARD_START.size)
        entry = f.read(SHARD_START.size)
    if len(entry) != SHARD_START.size:
        raise ValueError(f"{table} has no entry for shard {shard_id}; rerun the index rule")
    return SHARD_START.unpack(entry)


def read_shard(ds: DatasetConfig, shard: ShardSlice, skip=lambda i: False, columns: frozenset[str] | None = None) -> Iterator[SourceRow]:
    """Rows of one shard, in source order, each with its source_index; ``skip(i)`` rows are left out.

    ``columns``: the top-level columns the pipeline reads (``shard.rows.columns_read``); a
    Parquet or Hugging Face dataset decodes only those (a row is a dict of them), None: all.
    A JSONL line is parsed whole.

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
        return _read_parquet(shard.files, start, stop, skip, columns)
    return _read_loadable(ds, start, stop, skip, columns)
