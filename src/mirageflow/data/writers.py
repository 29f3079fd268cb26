"""Writers: shard part files (temp name, fsync, rename), the merged dataset.

Temp files and directories come from ``mirageflow.files`` (they follow the umask).

How records are stored (the same rule for part files, ``read_parts`` and ``merged/``):

- JSONL: one ``json.dumps(record, ensure_ascii=False)`` line per record, UTF-8; values as
  Python's json gives them (ints of any size stay ints). A string holding a lone surrogate
  is written as a ``\\udXXX`` escape (``ensure_ascii`` for that line only).
- Parquet: one column per field any record has (in first-seen order); a record without the
  field has null there. A column is stored with Arrow's type for its values when that
  keeps every value as it is; objects become structs whose fields are the union of the
  keys seen (a key an object lacks reads back as null). Otherwise (values of different
  types across rows: a string in one row and a number, bool, list or object in another;
  ints beyond int64; ints mixed with floats where an int is not exactly a double; bools
  mixed with numbers; str mixed with bytes; an empty object; values nested deeper than
  Parquet readers accept, ``MAX_PARQUET_DEPTH``) the whole column is stored as JSON text: each value ``json.dumps(value, ensure_ascii=False)``, null stays null,
  and the column's Parquet field metadata has ``mirageflow.encoding: json``
  (``is_json_field``), so ``json.loads`` gives the values back.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

from mirageflow.files import atomic_file, new_temp_dir, new_temp_file
from mirageflow.errors import MirageflowError

ENCODING_KEY = b"mirageflow.encoding"
JSON_ENCODING = b"json"
_JSON_META = {ENCODING_KEY: JSON_ENCODING}
_FLOAT_ONLY = {float, type(None)}
_EXACT_INT = 2**53  # ints up to this size are exactly a double (what Arrow's safe cast allows)


# --------------------------------------------------------------------------- JSON lines


def jsonl_line(record) -> bytes:
    """One JSONL line, UTF-8. A lone surrogate (not UTF-8) is written as its ``\\u`` escape."""
    try:
        return (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, ensure_ascii=True, default=str) + "\n").encode("utf-8")


def _jsonl_bytes(records: Iterable) -> bytes:
    text = "".join([json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records])
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # rare: only then line by line
        return b"".join(jsonl_line(r) for r in records)


# --------------------------------------------------------------------------- Arrow columns


def is_json_field(field) -> bool:
    """Whether a Parquet/Arrow column holds JSON text (see the module docstring)."""
    md = field.metadata
    return bool(md) and md.get(ENCODING_KEY) == JSON_ENCODING


def json_field(name: str):
    import pyarrow as pa

    return pa.field(name, pa.string(), metadata=_JSON_META)


def json_array(values: list):
    """Arrow strings: each value as JSON text, None as null."""
    import pyarrow as pa

    texts = [None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in values]
    try:
        return pa.array(texts, pa.string())
    except UnicodeEncodeError:  # a lone surrogate: escaped, as JSON allows
        texts = [None if v is None else json.dumps(v, ensure_ascii=True, default=str) for v in values]
        return pa.array(texts, pa.string())


@functools.lru_cache(maxsize=1024)
def _check(t) -> str:
    """What an inferred Arrow type needs: "json" (cannot be stored as is: an empty struct),
    "values" (holds a double or binary that other Python types may have been coerced into),
    or "" (nothing)."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        if t.num_fields == 0:
            return "json"
        found = [_check(t.field(i).type) for i in range(t.num_fields)]
        return "json" if "json" in found else ("values" if "values" in found else "")
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _check(t.value_type)
    if pa.types.is_floating(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "values"
    return ""


def _values_kept(values: list, t) -> bool:
    """Whether Arrow type ``t`` (inferred from ``values``) keeps every value as it is.

    Arrow's inference turns a bool or a big int among floats into a float, and a str
    among bytes into bytes; this walks the values at the float/binary places of ``t``.
    """
    import pyarrow as pa

    if pa.types.is_floating(t) and {type(v) for v in values} <= _FLOAT_ONLY:
        return True
    stack = [(v, t) for v in values]
    while stack:
        v, t = stack.pop()
        if v is None:
            continue
        if pa.types.is_floating(t):
            if type(v) is float or (type(v) is int and -_EXACT_INT <= v <= _EXACT_INT):
                continue
            return False
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            if isinstance(v, (bytes, bytearray, memoryview)):
                continue
            return False
        if not _check(t):
            continue
        if pa.types.is_struct(t):
            if isinstance(v, dict):
                stack.extend((v.get(t.field(i).name), t.field(i).type) for i in range(t.num_fields))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, t.value_type) for x in v)
    return True


# Parquet schema levels a reader accepts: pyarrow refuses ~100 ("schema too deeply nested"),
# a struct is one level, a list two. A column nested deeper is stored as JSON text.
MAX_PARQUET_DEPTH = 64


@functools.lru_cache(maxsize=1024)
def parquet_depth(t) -> int:
    """The Parquet schema levels Arrow type ``t`` takes."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return 1 + max((parquet_depth(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_map(t):
        return 2 + max(parquet_depth(t.key_type), parquet_depth(t.item_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 2 + parquet_depth(t.value_type)
    return 1


def column_array(values: list):
    """(Arrow array, stored as JSON text?) for one column's values; never raises for a value type."""
    import pyarrow as pa

    try:
        arr = pa.array(values)
    except Exception:  # ArrowInvalid / ArrowTypeError (mixed types), OverflowError (> int64), RecursionError ...
        return json_array(values), True
    check = _check(arr.type)
    if check == "json" or (check == "values" and not _values_kept(values, arr.type)):
        return json_array(values), True
    if parquet_depth(arr.type) > MAX_PARQUET_DEPTH:  # a part no reader could open: JSON text, losslessly
        return json_array(values), True
    return arr, False


def records_table(records: list[dict]):
    """An Arrow table of the records under the storage rule (module docstring)."""
    import pyarrow as pa

    if not records:
        return pa.table({})
    names = list(records[0])
    columns = None
    if sum(map(len, records)) == len(names) * len(records):
        try:  # every record has the first one's fields, and no others (the common case)
            columns = [[r[name] for r in records] for name in names]
        except KeyError:
            pass
    if columns is None:  # a field any record has is a column; the others have null there
        names = list(dict.fromkeys(k for r in records for k in r))
        columns = [[r.get(name) for r in records] for name in names]
    arrays, fields = [], []
    for name, values in zip(names, columns):
        arr, as_json = column_array(values)
        arrays.append(arr)
        fields.append(json_field(name) if as_json else pa.field(name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


# --------------------------------------------------------------------------- one schema for many tables


class ColumnNeedsJson(MirageflowError):
    """A column's values cannot be cast to the planned type without a change: store it as JSON."""

    def __init__(self, name: str, why: str):
        self.name = name
        super().__init__(f"column {name!r}: {why}")


def plan_schema(schemas: list, as_json: Iterable[str] = ()):
    """One schema for tables with these schemas, under the storage rule.

    A column is JSON text when any table has it as JSON, when it is in ``as_json``, or when
    its types cannot be unified by Arrow (null -> any, int -> wider int or float, structs
    -> union of their fields); ``conform`` finds, by a safe cast, when a unified type
    would change a value (ColumnNeedsJson).
    """
    import pyarrow as pa

    as_json = set(as_json)
    columns: dict[str, list] = {}
    for schema in schemas:
        for f in schema:
            columns.setdefault(f.name, []).append(f)
    fields = []
    for name, seen in columns.items():
        if name in as_json or any(is_json_field(f) for f in seen):
            fields.append(json_field(name))
            continue
        types = list(dict.fromkeys(f.type for f in seen))
        if len(types) == 1:
            fields.append(pa.field(name, types[0]))
            continue
        try:
            unified = pa.unify_schemas([pa.schema([pa.field(name, t)]) for t in types], promote_options="permissive")
            fields.append(pa.field(name, unified.field(name).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            fields.append(json_field(name))
    return pa.schema(fields)


def conform(table, schema):
    """``table`` with exactly ``schema``'s columns: cast without loss, encoded as JSON text, or
    null where the table lacks the column. Raises ColumnNeedsJson when a cast would change a value."""
    import pyarrow as pa

    columns = []
    for f in schema:
        if f.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if is_json_field(f):
            if is_json_field(table.schema.field(f.name)):
                columns.append(col.cast(pa.string()))
            else:
                columns.append(json_array(col.to_pylist()))
            continue
        if col.type == f.type:
            columns.append(col)
            continue
        try:
            columns.append(col.cast(f.type))  # safe: fails rather than truncate or round
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise ColumnNeedsJson(f.name, f"cannot cast {col.type} to {f.type} without a change ({e})") from None
    return pa.Table.from_arrays(columns, schema=schema)


def unify_tables(tables: list):
    """The tables as one, under the storage rule (a column whose types disagree becomes JSON text)."""
    import pyarrow as pa

    tables = [t for t in tables if t.num_rows]
    if not tables:
        return None
    as_json: set[str] = set()
    while True:
        schema = plan_schema([t.schema for t in tables], as_json)
        try:
            return pa.concat_tables([conform(t, schema) for t in tables])
        except ColumnNeedsJson as e:
            as_json.add(e.name)


# --------------------------------------------------------------------------- part files


def write_part(path: Path, records: list[dict], fmt: str) -> None:
    """Write records as one Parquet/JSONL file, atomically (temp name, fsync, rename).

    Every field of every record is kept, under the storage rule (module docstring); no
    value type makes it fail.
    """
    path = Path(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = records_table(records)
    else:
        data = _jsonl_bytes(records)
    if fmt != "parquet":
        with atomic_file(path) as f:
            f.write(data)
        return
    fd, tmp = new_temp_file(path)
    try:
        os.close(fd)
        pq.write_table(table, str(tmp))  # by path: faster than through a Python file; the mode stays
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class PartUnreadable(MirageflowError, OSError):
    """A part file cannot be read; the message names it."""


def read_part_table(path: Path):
    """One Parquet part as an Arrow table; PartUnreadable (naming the file) when it cannot be read."""
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except Exception as e:
        raise PartUnreadable(f"{path}: cannot read this Parquet part file ({type(e).__name__}: {e})") from e


def read_jsonl_part(path: Path) -> list[dict]:
    """One JSONL part's records (ints of any size kept); PartUnreadable naming the file and line."""
    records = []
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    records.append(json.loads(line))
    except (OSError, ValueError) as e:
        raise PartUnreadable(f"{path}: cannot read this JSONL part file ({type(e).__name__}: {e})") from e
    return records


def read_parts(shard_dir: Path, fmt: str):
    """The shard's records as one Arrow table (None when it wrote none), under the storage rule."""
    parts = sorted(Path(shard_dir).glob(f"part-*.{fmt}"))
    if fmt == "parquet":
        return unify_tables([read_part_table(p) for p in parts])
    records = [r for p in parts for r in read_jsonl_part(p)]
    return records_table(records) if records else None


# --------------------------------------------------------------------------- merged/


def write_merged_part(path: Path, item, fmt: str) -> int:
    """One part file of merged/ (or deduplicated/), atomically (temp name, fsync, rename);
    returns its rows. ``item`` is an Arrow table, or (JSONL) a list of lines (bytes, each
    ending in a newline) written byte for byte."""
    path = Path(path)
    with atomic_file(path) as f:
        if isinstance(item, list):
            f.writelines(item)
            rows = len(item)
        elif fmt == "parquet":
            import pyarrow.parquet as pq  # not for JSONL lines: a dedup_write job of JSONL parts never loads it

            pq.write_table(item, f)
            rows = item.num_rows
        else:
            f.write(_jsonl_bytes(item.to_pylist()))
            rows = item.num_rows
    return rows


def merged_part_name(index: int, fmt: str) -> str:
    return f"part-{index:05d}.{fmt}"


def replace_dir(new: Path, out_dir: Path) -> None:
    """Put the directory ``new`` in place of ``out_dir`` (renames: a reader sees the old
    one or the new one, whole)."""
    old = out_dir.with_name(f".{out_dir.name}.old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(new, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def write_merged(tables: Iterable, out_dir: Path, fmt: str) -> int:
    """Write tables (in order) as merged/part-NNNNN files, replacing the old merged dir atomically.

    An item is an Arrow table, or (JSONL) a list of lines (bytes, each ending in a newline)
    written byte for byte.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_dir(out_dir)
    rows = 0
    try:
        for i, table in enumerate(tables):
            rows += write_merged_part(tmp / merged_part_name(i, fmt), table, fmt)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rows
