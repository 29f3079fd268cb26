"""Hostile inputs for the readers, part writers and the merge: nothing is lost, changed or
stops a shard silently.

- a reader yields exactly one SourceRow per index of its range (a dict or a RowError), or
  raises DatasetReadError naming the file;
- a row that would kill the shard later (lone surrogates) is a row error at read time;
- Parquet MAP input has a lossless Python form;
- every field a record has is kept, and values of mixed types are stored losslessly
  (as JSON text, marked in the field metadata);
- the merge keeps every value as written and names the part file it cannot read;
- files and directories follow the umask.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mirageflow.config import DatasetConfig
from mirageflow.data import readers
from mirageflow.data.merge import MergeRefused, merge_dataset
from mirageflow.data.readers import ShardSlice, SourceRow, load_shard, read_shard, write_index
from mirageflow.data.sharding import shard_range
from mirageflow.data.writers import read_parts, write_part
from mirageflow.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from mirageflow.errors import RowError
from fakes.configs import merge_config
from fakes.runs import finish_shard

JSON_META = {b"mirageflow.encoding": b"json"}

# --------------------------------------------------------------------------- helpers


def dataset(path, kind: str, output_dir="unused", fmt="parquet") -> DatasetConfig:
    return DatasetConfig(index=0, path=str(path), type=kind, output_dir=str(output_dir), output_format=fmt, split=None)


def assert_one_row_per_index(rows: list, start: int, stop: int, skip=lambda i: False) -> None:
    """The reader's promise: one SourceRow per index not skipped, in order, a dict or a RowError."""
    assert all(isinstance(r, SourceRow) for r in rows)
    assert [r.index for r in rows] == [i for i in range(start, stop) if not skip(i)]
    assert all(isinstance(r.value, (dict, RowError)) for r in rows)


def read_all(ds, num_shards: int, skip=lambda i: False) -> list[SourceRow]:
    """Every shard's rows (checked against the promise), concatenated."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "dataset_0.index.json"
        n = write_index(ds, num_shards, index)["rows"]
        for s in range(num_shards):
            shard = load_shard(index, ds, num_shards, s)
            rows = list(read_shard(ds, shard, skip=skip))
            assert_one_row_per_index(rows, *shard_range(n, num_shards, s), skip)
            out.extend(rows)
    return out


def errors(rows) -> dict[int, RowError]:
    return {r.index: r.value for r in rows if isinstance(r.value, RowError)}


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0, True is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def decoded(table: pa.Table) -> list[dict]:
    """Rows of a table written under the storage rule, JSON-text columns decoded."""
    json_cols = {f.name for f in table.schema if f.metadata and f.metadata.get(b"mirageflow.encoding") == b"json"}
    rows = table.to_pylist()
    for row in rows:
        for name in json_cols:
            if row[name] is not None:
                row[name] = json.loads(row[name])
    return rows


def corrupt_first_row_group(path: Path) -> None:
    """Overwrite bytes in the middle of the file's first row group (its data pages)."""
    rg = pq.ParquetFile(path).metadata.row_group(0)
    cols = [rg.column(i) for i in range(rg.num_columns)]
    lo = min(min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset) for c in cols)
    hi = max(c.data_page_offset + c.total_compressed_size for c in cols)
    data = bytearray(path.read_bytes())
    mid = (lo + hi) // 2
    data[mid : mid + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- 1. JSONL rows that raise


def test_deeply_nested_jsonl_row_is_a_row_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    path.write_text(f'{{"id": 0}}\n{deep}\n{{"id": 2}}\n')
    for k in (1, 2, 3):
        rows = read_all(dataset(path, "jsonl"), k)
        assert [r.value for r in rows if not isinstance(r.value, RowError)] == [{"id": 0}, {"id": 2}]
        [(index, err)] = errors(rows).items()
        assert index == 1 and (err.stage, err.kind) == ("read", "bad_row")
        assert f"{path}:2:" in str(err) and "RecursionError" in str(err)


def test_any_exception_parsing_a_line_is_that_rows_error(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 0}\n{"id": "explode"}\n\n{"id": 2}\n')
    real = json.loads

    def loads(s, *args, **kwargs):
        if "explode" in s:
            raise RuntimeError("parser blew up")
        return real(s, *args, **kwargs)

    monkeypatch.setattr(readers.json, "loads", loads)
    rows = read_all(dataset(path, "jsonl"), 1)
    assert [r.value for r in rows if not isinstance(r.value, RowError)] == [{"id": 0}, {"id": 2}]
    err = errors(rows)[1]
    assert err.kind == "bad_row" and f"{path}:2:" in str(err) and "parser blew up" in str(err)


def test_jsonl_shorter_than_its_index_is_a_named_failure(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 0}\n{"id": 1}\n')
    rows = read_shard(dataset(path, "jsonl"), ShardSlice(0, 5, 0, 1))
    with pytest.raises(readers.DatasetReadError, match=str(path)) as e:
        list(rows)
    assert isinstance(e.value, OSError)


def test_missing_jsonl_is_a_named_failure(tmp_path):
    path = tmp_path / "gone.jsonl"
    with pytest.raises(readers.DatasetReadError, match="gone.jsonl"):
        list(read_shard(dataset(path, "jsonl"), ShardSlice(0, 1, 0, 1)))


# --------------------------------------------------------------------------- 1. Parquet / loadable


@pytest.fixture
def two_row_groups(tmp_path) -> Path:
    path = tmp_path / "pq" / "data.parquet"
    path.parent.mkdir()
    table = pa.table({"id": list(range(200)), "text": [f"row {i} " * 20 for i in range(200)]})
    pq.write_table(table, path, row_group_size=100)
    assert pq.ParquetFile(path).num_row_groups == 2
    return path


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_corrupt_parquet_row_group_keeps_the_others(two_row_groups, k):
    ds = dataset(two_row_groups, "parquet")
    corrupt_first_row_group(two_row_groups)  # the footer is intact: it indexes
    rows = read_all(ds, k)
    assert len(rows) == 200
    bad = errors(rows)
    assert sorted(bad) == list(range(100))
    for err in bad.values():
        assert (err.stage, err.kind) == ("read", "unreadable_row_group")
        assert str(two_row_groups) in str(err) and "row group 0" in str(err)
    assert [r.value["id"] for r in rows[100:]] == list(range(100, 200))
    assert rows[150].value["text"] == "row 150 " * 20


def test_corrupt_row_group_of_committed_rows_is_not_read(two_row_groups):
    corrupt_first_row_group(two_row_groups)
    skip = lambda i: i < 100 or i % 2 == 0  # noqa: E731
    rows = read_all(dataset(two_row_groups, "parquet"), 2, skip=skip)
    assert not errors(rows) and [r.index for r in rows] == list(range(101, 200, 2))


def test_unreadable_parquet_footer_is_a_named_failure(two_row_groups):
    slice_ = ShardSlice(0, 200, files=[{"path": str(two_row_groups), "rows": 200}])
    data = two_row_groups.read_bytes()
    two_row_groups.write_bytes(data[: len(data) - 20])  # truncated: no footer
    with pytest.raises(readers.DatasetReadError, match=str(two_row_groups)) as e:
        list(read_shard(dataset(two_row_groups, "parquet"), slice_))
    assert isinstance(e.value, OSError)


def test_unreadable_parquet_footer_at_indexing_names_the_file(two_row_groups, tmp_path):
    two_row_groups.write_bytes(b"PAR1 not really")
    with pytest.raises(readers.DatasetReadError, match=str(two_row_groups)):
        write_index(dataset(two_row_groups.parent, "parquet"), 1, tmp_path / "i.index.json")


def test_parquet_value_that_cannot_be_converted_is_that_rows_error(tmp_path):
    path = tmp_path / "ts.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "ts": pa.array([0, 2**62, 2], pa.timestamp("ms"))}), path)
    rows = read_all(dataset(path, "parquet"), 1)
    assert sorted(errors(rows)) == [1] and "row 1" in str(errors(rows)[1]) and str(path) in str(errors(rows)[1])
    assert [rows[0].value["id"], rows[2].value["id"]] == [0, 2]


def test_loadable_chunk_that_cannot_be_read_keeps_its_other_rows(tmp_path):
    import datasets

    table = pa.table({"id": list(range(5)), "ts": pa.array([0, 1, 2**62, 3, 4], pa.timestamp("s"))})
    datasets.Dataset(table).save_to_disk(str(tmp_path / "hf"))
    for k in (1, 2):
        rows = read_all(dataset(tmp_path / "hf", "loadable"), k)
        assert sorted(errors(rows)) == [2] and str(tmp_path / "hf") in str(errors(rows)[2])
        assert [r.value["id"] for r in rows if r.index != 2] == [0, 1, 3, 4]


def test_unloadable_dataset_is_a_named_failure(tmp_path):
    with pytest.raises(readers.DatasetReadError, match="nothing-here"):
        list(read_shard(dataset(tmp_path / "nothing-here", "loadable"), ShardSlice(0, 3)))


def test_dataset_files_is_public(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("{}\n")
    assert readers.dataset_files(dataset(path, "jsonl")) == [str(path)]


# --------------------------------------------------------------------------- 2. lone surrogates


def test_lone_surrogates_are_row_errors(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_bytes(
        b'{"id": 0, "text": "fine \\ud83d\\ude00"}\n'  # a valid pair: one character
        b'{"id": 1, "text": "bad \\ud800 here"}\n'  # lone surrogate as an escape
        b'{"id": 2, "text": "raw \xed\xa0\x80 bytes"}\n'  # ... as UTF-8-encoded bytes (CESU)
        b'{"id": 3, "meta": {"tags": ["ok", "\\uDC00"]}}\n'  # nested, upper-case escape
        b'{"id": 4, "\\udfff": 1}\n'  # in a key
        b'{"id": 5, "text": "\\\\ud800 is how you write it"}\n'  # an escaped backslash: fine
    )
    rows = read_all(dataset(path, "jsonl"), 2)
    assert rows[0].value == {"id": 0, "text": "fine \U0001f600"}
    assert rows[5].value == {"id": 5, "text": "\\ud800 is how you write it"}
    bad = errors(rows)
    assert sorted(bad) == [1, 2, 3, 4]
    for i, err in bad.items():
        assert (err.stage, err.kind) == ("read", "invalid_unicode")
        assert f"{path}:{i + 1}:" in str(err)
        str(err).encode("utf-8")  # the message itself is valid UTF-8
    assert "text" in str(bad[1]) and "meta.tags[1]" in str(bad[3])


def test_a_byte_order_mark_at_a_lines_start_is_dropped_as_utf_8_sig_does(tmp_path):
    """Each line is UTF-8 with an optional BOM (``utf-8-sig``): the first line of a file saved
    by an editor that writes one, or files concatenated; a BOM anywhere else is text."""
    path = tmp_path / "bom.jsonl"
    bom = "\ufeff".encode()
    path.write_bytes(bom + b'{"id": 0}\n' + b'{"id": 1, "t": "x' + bom + b'y"}\n' + bom + b'{"id": 2}\n' + bom + bom + b'{"id": 3}\n')
    for k in (1, 2):
        rows = read_all(dataset(path, "jsonl"), k)
        assert [r.value for r in rows[:3]] == [{"id": 0}, {"id": 1, "t": "x\ufeffy"}, {"id": 2}]
        assert (rows[3].value.stage, rows[3].value.kind) == ("read", "bad_row")  # a second BOM is not JSON


# --------------------------------------------------------------------------- 3. MAP columns


def test_parquet_map_columns_are_lossless_end_to_end(tmp_path):
    path = tmp_path / "maps.parquet"
    str_map = pa.array([[("a", 1), ("b", 2)], None, [("c", 3)], []], pa.map_(pa.string(), pa.int64()))
    int_map = pa.array([[(1, "x"), (2, "y")], [], None, [(3, "z")]], pa.map_(pa.int64(), pa.string()))
    dup_map = pa.array([[("k", 1), ("k", 2)], [("k", 1)], None, []], pa.map_(pa.string(), pa.int64()))
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "m": str_map, "im": int_map, "dm": dup_map}), path)

    rows = [r.value for r in read_all(dataset(path, "parquet"), 1)]
    assert [r["m"] for r in rows] == [{"a": 1, "b": 2}, None, {"c": 3}, {}]
    assert [r["im"] for r in rows] == [[[1, "x"], [2, "y"]], {}, None, [[3, "z"]]]
    assert [r["dm"] for r in rows] == [[["k", 1], ["k", 2]], {"k": 1}, None, {}]

    # through a part file and the merge (records carry the row's columns, as remove_columns: false does)
    cfg, ds = merge_config(tmp_path, 2)
    records = [{**r, "source_index": i} for i, r in enumerate(rows)]
    finish_shard(cfg, ds, 0, records[:2])
    finish_shard(cfg, ds, 1, records[2:])
    assert merge_dataset(cfg, ds)["rows"] == 4
    merged = decoded(pq.read_table(Path(ds.output_dir) / "merged"))
    for got, want in zip(merged, records):
        assert same(got["im"], want["im"]) and same(got["dm"], want["dm"])  # JSON text: exact
        # string-keyed maps are objects -> structs: the union of keys, a key a row lacks is null
        assert got["m"] == (None if want["m"] is None else {"a": None, "b": None, "c": None, **want["m"]})


# --------------------------------------------------------------------------- 4. every field kept


def test_parquet_part_keeps_fields_absent_from_the_first_record(tmp_path):
    records = [{"source_index": 0, "text": "t0"}] + [
        {"source_index": i, "text": f"t{i}", "lang": "en", "": "empty", "a.b": i, " ": "sp", "meta": {"x": i}} for i in range(1, 20)
    ]
    records.append({"source_index": 20, "meta": {"y": "late"}})
    path = tmp_path / "part-00000.parquet"
    write_part(path, records, "parquet")
    table = pq.read_table(path)
    got = table.to_pylist()
    assert [r["lang"] for r in got] == [None] + ["en"] * 19 + [None]
    assert [r[""] for r in got][1:3] == ["empty", "empty"] and got[5]["a.b"] == 5 and got[5][" "] == "sp"
    assert got[3]["meta"] == {"x": 3, "y": None} and got[20]["meta"] == {"x": None, "y": "late"}
    assert got[20]["text"] is None
    for want, row in zip(records, got):  # every field a record has, with its value
        assert {k: row[k] for k in want if k != "meta"} == {k: v for k, v in want.items() if k != "meta"}
    assert read_parts(tmp_path, "parquet").to_pylist() == got


# --------------------------------------------------------------------------- 5. mixed types


MIXED = [
    ("answer", ["x", 1, True, [1, "a"], {"k": "v"}, None, 2.5]),  # str among others
    ("id", [1, "2", 3, "four", 5, 6, 7]),  # int in some rows, str in others
    ("big", [1, 2**64, -(2**70), 3, None, 4, 5]),  # ints beyond int64
    ("exact", [2**60 + 1, 0.5, 1, 2, 3, 4, 5]),  # ints that are not exactly a double, with floats
    ("flag", [1.5, True, None, 2.0, False, 0.0, 1.0]),  # bools among floats
    ("nested", [[1.5], [2**60 + 1], [], None, [0.25], [1], [2]]),  # ... inside lists
    ("obj", [{"a": 1.5}, {"a": True}, {}, None, {"a": 2}, {"a": 3}, {"a": 4}]),  # ... inside objects
    ("empty", [{}, {}, None, {}, {}, {}, {}]),  # an empty object (not storable as a struct)
    ("bytes_str", ["text", b"raw", None, "t", "u", "v", "w"]),  # str among bytes
    ("surrogate", ["ok", "lone \ud800", None, "a", "b", "c", "d"]),  # not UTF-8
]


def mixed_records() -> list[dict]:
    return [{"source_index": i, **{name: values[i] for name, values in MIXED}} for i in range(7)]


def test_mixed_type_columns_are_stored_losslessly_as_json(tmp_path):
    records = mixed_records()
    path = tmp_path / "part-00000.parquet"
    write_part(path, records, "parquet")
    table = pq.read_table(path)
    for name, _ in MIXED:
        assert table.schema.field(name).metadata == JSON_META, name
        assert table.schema.field(name).type == pa.string()
    assert table.schema.field("source_index").type == pa.int64() and not table.schema.field("source_index").metadata
    for got, want in zip(decoded(table), records):
        for name, _ in MIXED:
            if name == "bytes_str" and isinstance(want[name], bytes):
                assert got[name] == str(want[name])  # bytes have no JSON form: str(), as JSONL output does
            else:
                assert same(got[name], want[name]), (name, got[name], want[name])


def test_columns_of_one_type_keep_their_arrow_type(tmp_path):
    records = [
        {"source_index": i, "text": f"t{i}", "score": i / 2, "n": i, "ok": i % 2 == 0, "tags": ["a"] * i, "meta": {"k": i}}
        for i in range(5)
    ]
    records[1]["score"] = 1  # an int that is exactly a double: a double column, as Arrow does
    write_part(tmp_path / "p.parquet", records, "parquet")
    schema = pq.read_schema(tmp_path / "p.parquet")
    assert all(not f.metadata for f in schema)
    assert [f.type for f in schema] == [
        pa.int64(),
        pa.string(),
        pa.float64(),
        pa.int64(),
        pa.bool_(),
        pa.list_(pa.string()),
        pa.struct([("k", pa.int64())]),
    ]


def test_jsonl_part_is_lossless(tmp_path):
    records = mixed_records()
    records = [{k: v for k, v in r.items() if k != "bytes_str"} for r in records]
    write_part(tmp_path / "p.jsonl", records, "jsonl")
    lines = (tmp_path / "p.jsonl").read_bytes().decode("utf-8").splitlines()
    assert all(same(json.loads(line), r) for line, r in zip(lines, records))


# --------------------------------------------------------------------------- 6. merge


def test_jsonl_merge_keeps_every_line_byte_for_byte(tmp_path):
    cfg, ds = merge_config(tmp_path, 2, fmt="jsonl")
    rows = [
        {"id": 2**64 + 1, "text": "grüße", "source_index": 0},
        {"id": 1, "x": 1.0, "source_index": 1},
        {"source_index": 2, "id": -(2**70), "nested": {"source_index": 99}},  # source_index first
        {"id": 3, "note": 'say "source_index": 7}', "source_index": 3},
        {"id": 4, "x": 2.5, "source_index": 4},
    ]
    finish_shard(cfg, ds, 0, [rows[1], rows[0], rows[2]], per_part=1)  # parts in completion order
    finish_shard(cfg, ds, 1, rows[3:])
    assert merge_dataset(cfg, ds)["rows"] == 5
    part_lines = {}
    for p in (Path(ds.output_dir)).glob("shard_*/part-*.jsonl"):
        for line in p.read_bytes().splitlines(keepends=True):
            part_lines[json.loads(line)["source_index"]] = line
    merged = b"".join(p.read_bytes() for p in sorted((Path(ds.output_dir) / "merged").glob("part-*.jsonl")))
    assert merged == b"".join(part_lines[i] for i in range(5))
    assert all(same(json.loads(line), row) for line, row in zip(merged.splitlines(), rows))


def test_parquet_merge_type_changes_across_parts_and_shards_are_lossless(tmp_path):
    """Each part has one type per column (one row per part); the types differ across parts."""
    cfg, ds = merge_config(tmp_path, 3)
    rows = [
        {"source_index": 0, "answer": 1, "n": 2**60 + 1, "same": "a", "widen": 1},
        {"source_index": 1, "answer": "one", "n": 7, "same": "b", "widen": 2},  # 2nd part of shard 0
        {"source_index": 2, "answer": [1, 2], "n": 0.5, "same": "c", "widen": 2.5},
        {"source_index": 3, "answer": {"k": "x"}, "n": 1.25, "same": None, "widen": None},
        {"source_index": 4, "answer": True, "n": -3, "same": "e", "widen": 3},
    ]
    finish_shard(cfg, ds, 0, rows[:2], per_part=1)
    finish_shard(cfg, ds, 1, rows[2:4], per_part=1)
    finish_shard(cfg, ds, 2, rows[4:], per_part=1)
    assert merge_dataset(cfg, ds)["rows"] == 5
    table = pq.read_table(Path(ds.output_dir) / "merged")
    assert table.schema.field("answer").metadata == JSON_META and table.schema.field("n").metadata == JSON_META
    assert table.schema.field("same").type == pa.string() and not table.schema.field("same").metadata
    assert table.schema.field("widen").type == pa.float64()  # ints exactly doubles: widened, as before
    for got, want in zip(decoded(table), rows):
        assert same(got["answer"], want["answer"]) and same(got["n"], want["n"]) and got["same"] == want["same"]
        assert got["widen"] == want["widen"]


def test_parquet_merge_of_big_ints_and_floats_across_shards(tmp_path):
    cfg, ds = merge_config(tmp_path, 2)
    finish_shard(cfg, ds, 0, [{"source_index": 0, "score": 2**60 + 1}])
    finish_shard(cfg, ds, 1, [{"source_index": 1, "score": 0.5}])
    assert merge_dataset(cfg, ds)["rows"] == 2
    table = pq.read_table(Path(ds.output_dir) / "merged")
    assert table.schema.field("score").metadata == JSON_META
    assert [r["score"] for r in decoded(table)] == [2**60 + 1, 0.5]


def test_parquet_merge_keeps_json_encoded_parts_as_they_are(tmp_path):
    cfg, ds = merge_config(tmp_path, 2)
    rows = [
        {"source_index": 0, "n": 1, "t": "a"},
        {"source_index": 1, "n": 2**64, "t": "b"},  # a JSON part: an int beyond int64
        {"source_index": 2, "n": 2, "t": "c"},
    ]
    finish_shard(cfg, ds, 0, rows[:1])
    finish_shard(cfg, ds, 1, rows[1:], per_part=1)
    assert pq.read_schema(Path(ds.output_dir) / "shard_1" / "part-00000.parquet").field("n").metadata == JSON_META
    assert merge_dataset(cfg, ds)["rows"] == 3
    table = pq.read_table(Path(ds.output_dir) / "merged")
    assert table.schema.field("n").metadata == JSON_META and not table.schema.field("t").metadata
    assert table.column("n").to_pylist() == ["1", str(2**64), "2"]  # not encoded twice
    assert [r["n"] for r in decoded(table)] == [1, 2**64, 2]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_merge_names_a_damaged_part(tmp_path, fmt):
    cfg, ds = merge_config(tmp_path, 2, fmt=fmt)
    finish_shard(cfg, ds, 0, [{"source_index": i, "text": f"r{i}" * 50} for i in range(4)])
    finish_shard(cfg, ds, 1, [{"source_index": i, "text": f"r{i}" * 50} for i in range(4, 6)])
    part = Path(ds.output_dir) / "shard_0" / f"part-00001.{fmt}"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2 + 5])  # truncated mid-row
    with pytest.raises(MergeRefused, match=str(part)) as e:
        merge_dataset(cfg, ds)
    assert "shard 0" in str(e.value) and "rerun" in str(e.value)
    assert not (Path(ds.output_dir) / "merged").exists()
    assert not [p for p in Path(ds.output_dir).iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- 7. umask


@pytest.fixture(params=[0o002, 0o022])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_files_follow_the_umask(tmp_path, umask, fmt):
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    atomic_write_bytes(tmp_path / "a" / "b.bin", b"x")
    atomic_write_text(tmp_path / "a" / "t.txt", "x")
    atomic_write_json(tmp_path / "a" / "j.json", {"x": 1})
    for name in ("b.bin", "t.txt", "j.json"):
        assert mode(tmp_path / "a" / name) == file_mode, name
    assert mode(tmp_path / "a") == dir_mode

    cfg, ds = merge_config(tmp_path, 2, fmt=fmt)
    finish_shard(cfg, ds, 0, [{"source_index": 0, "t": "a"}])
    finish_shard(cfg, ds, 1, [{"source_index": 1, "t": "b"}])
    assert mode(Path(ds.output_dir) / "shard_0" / f"part-00000.{fmt}") == file_mode
    merge_dataset(cfg, ds)
    merged = Path(ds.output_dir) / "merged"
    assert mode(merged) == dir_mode
    assert [mode(p) for p in merged.iterdir()] == [file_mode, file_mode]


def test_merge_refuses_when_a_shards_parts_do_not_hold_what_its_status_counted(tmp_path):
    """Before: deleting a damaged part and rerunning gave a merged/ with its rows silently missing."""
    cfg, ds = merge_config(tmp_path, 2, fmt="jsonl")
    finish_shard(cfg, ds, 0, [{"q": f"r{i}", "source_index": i} for i in range(4)])
    finish_shard(cfg, ds, 1, [{"q": f"r{i}", "source_index": i} for i in range(4, 8)])
    (Path(ds.output_dir) / "shard_1" / "part-00001.jsonl").write_text("")  # two records lost
    with pytest.raises(MergeRefused, match=r"shard 1's parts hold 2 records, its status.json counts 4"):
        merge_dataset(cfg, ds)
    assert not (Path(ds.output_dir) / "merged").exists()
    atomic_write_text(cfg.shard_dir(0) / "status.json", "[]")
    with pytest.raises(MergeRefused, match=r"damaged status files: .*shard_0/status.json"):
        merge_dataset(cfg, ds)


def test_a_dataset_rewritten_with_the_same_bytes_keeps_its_index(tmp_path):
    """Snakemake skips re-indexing such a file (same checksum); the shards must not then fail
    with 'changed after it was indexed' once the driver identified it (its content cache).
    A real change of content is still caught."""
    from mirageflow.state.inputs import ContentCache, dataset_changed

    src = tmp_path / "in.jsonl"
    src.write_text('{"q": "a"}\n{"q": "b"}\n')
    ds = DatasetConfig(0, str(src), "jsonl", str(tmp_path / "out"), "parquet", None)
    write_index(ds, 1, tmp_path / "i.index.json")
    os.utime(src, ns=(1, 1))  # rewritten, same content
    cache = ContentCache(tmp_path / "content.json")
    assert dataset_changed(ds, cache, tmp_path / "i.index.json") is None  # the driver, at DAG build
    cache.save()
    assert load_shard(tmp_path / "i.index.json", ds, 1, 0).stop == 2
    src.write_text('{"q": "a"}\n{"q": "c"}\n')  # same size, new content
    with pytest.raises(ValueError, match="changed after it was indexed"):
        load_shard(tmp_path / "i.index.json", ds, 1, 0)
    assert "changed since it was indexed" in dataset_changed(ds, ContentCache(tmp_path / "content.json"), tmp_path / "i.index.json")
