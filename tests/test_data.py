"""Sharding, dataset readers (JSONL, Parquet, loadable), shard writers and the merge."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fakes.configs import merge_config
from fakes.runs import finish_shard

from mirageflow.config import DatasetConfig
from mirageflow.data.merge import MergeRefused, merge_dataset
from mirageflow.data.readers import SHARD_START, load_shard, offsets_path, read_shard, write_index
from mirageflow.data.sharding import shard_range
from mirageflow.data.writers import read_parts, write_part
from mirageflow.files import atomic_write_json
from mirageflow.errors import RowError

# --------------------------------------------------------------------------- helpers


def dataset(path, kind: str, split: str | None = None, output_dir="unused") -> DatasetConfig:
    return DatasetConfig(index=0, path=str(path), type=kind, output_dir=str(output_dir), output_format="parquet", split=split)


def read_shards(ds: DatasetConfig, num_shards: int) -> list[list]:
    """Every shard's rows, shard by shard, from one index."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dataset_0.index.json"
        header = write_index(ds, num_shards, path)
        assert header["num_shards"] == num_shards and "shards" not in header
        return [list(read_shard(ds, load_shard(path, ds, num_shards, s))) for s in range(num_shards)]


def assert_shards_cover(shards: list[list], expected_rows: list) -> None:
    """Concatenated shards are all rows in order, each shard exactly its shard_range."""
    n, k = len(expected_rows), len(shards)
    for s, rows in enumerate(shards):
        start, stop = shard_range(n, k, s)
        assert [r.index for r in rows] == list(range(start, stop)), f"shard {s} of {k}"
    flat = [r for rows in shards for r in rows]
    assert [r.index for r in flat] == list(range(n))
    assert [r.value for r in flat] == expected_rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())


# --------------------------------------------------------------------------- shard_range


def mmirage_range(n: int, k: int, i: int) -> tuple[int, int]:
    """MMIRAGE's formula, written out independently."""
    div, mod = divmod(n, k)
    start = div * i + min(i, mod)
    size = div + (1 if i < mod else 0)
    return start, start + size


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 101])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 16])
def test_shard_ranges_partition_rows(n, k):
    ranges = [shard_range(n, k, i) for i in range(k)]
    covered = [row for a, b in ranges for row in range(a, b)]
    assert covered == list(range(n))  # union is everything, no overlap, in order
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (a0, b0), (a1, b1) in zip(ranges, ranges[1:]):
        assert b0 == a1  # contiguous
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the bigger shards come first
    assert ranges == [mmirage_range(n, k, i) for i in range(k)]


def test_shard_range_examples():
    assert [shard_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("k, i", [(3, 3), (3, -1), (1, 1), (0, 0)])
def test_invalid_shard_id_raises(k, i):
    with pytest.raises(ValueError):
        shard_range(10, k, i)


# --------------------------------------------------------------------------- JSONL


JSONL_TEXT = (
    '{"id": 0, "text": "zero"}\n'  # line 1, row 0
    "\n"  # line 2: blank
    '{"id": 1, "text": "one"}\n'  # line 3, row 1
    '{"id": 2, "text": broken\n'  # line 4, row 2: malformed
    "[1, 2, 3]\n"  # line 5, row 3: not an object
    "   \t\n"  # line 6: blank
    '{"id": 5, "text": "fünf"}\n'  # line 7, row 4
    '{"id": 6, "text": "six"}'  # line 8, row 5, no trailing newline
)


@pytest.fixture
def messy_jsonl(tmp_path) -> Path:
    path = tmp_path / "messy.jsonl"
    path.write_bytes(JSONL_TEXT.encode())
    return path


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 9])
def test_jsonl_shards_cover_all_rows(messy_jsonl, k):
    ds = dataset(messy_jsonl, "jsonl")
    shards = read_shards(ds, k)
    flat = [r for rows in shards for r in rows]
    assert [r.index for r in flat] == list(range(6))
    good = {r.index: r.value for r in flat if not isinstance(r.value, RowError)}
    assert good == {
        0: {"id": 0, "text": "zero"},
        1: {"id": 1, "text": "one"},
        4: {"id": 5, "text": "fünf"},
        5: {"id": 6, "text": "six"},
    }
    # line numbers are right whichever shard the bad line falls in
    malformed, not_object = flat[2].value, flat[3].value
    assert isinstance(malformed, RowError) and isinstance(not_object, RowError)
    assert (malformed.stage, malformed.kind) == ("read", "bad_row")
    assert f"{messy_jsonl}:4: not valid JSON" in str(malformed)
    assert (not_object.stage, not_object.kind) == ("read", "bad_row")
    assert f"{messy_jsonl}:5: line is a JSON list" in str(not_object)
    for s, rows in enumerate(shards):
        start, stop = shard_range(6, k, s)
        assert [r.index for r in rows] == list(range(start, stop))


def test_jsonl_index_counts_nonblank_lines(messy_jsonl, tmp_path):
    ds = dataset(messy_jsonl, "jsonl")
    path = tmp_path / "dataset_0.index.json"
    assert write_index(ds, 2, path)["rows"] == 6
    slices = [load_shard(path, ds, 2, s) for s in range(2)]
    assert [(s.start, s.stop, s.line) for s in slices] == [(0, 3, 1), (3, 6, 5)]
    assert messy_jsonl.read_bytes()[slices[1].offset :].startswith(b"[1, 2, 3]\n")


def test_shard_reads_a_fixed_amount_of_the_index(tmp_path):
    """What a shard job reads does not grow with the number of shards: a fixed-size header
    and one fixed-size entry of the table."""
    ds = dataset(write_jsonl(tmp_path / "d.jsonl", [{"i": i} for i in range(50)]), "jsonl")
    sizes = {}
    for k in (10, 10_000):
        path = tmp_path / f"k{k}" / "dataset_0.index.json"
        write_index(ds, k, path)
        sizes[k] = path.stat().st_size
        assert offsets_path(path).stat().st_size == k * SHARD_START.size
        last = load_shard(path, ds, k, k - 1)
        assert (last.start, last.stop) == shard_range(50, k, k - 1)
    assert abs(sizes[10_000] - sizes[10]) <= 3  # "num_shards": 10 vs 10000


def test_index_for_another_shard_count_is_refused(tmp_path):
    ds = dataset(write_jsonl(tmp_path / "d.jsonl", [{"i": 0}]), "jsonl")
    path = tmp_path / "dataset_0.index.json"
    write_index(ds, 2, path)
    with pytest.raises(ValueError, match="rerun its index rule"):
        load_shard(path, ds, 3, 0)


def test_jsonl_many_rows(tmp_path):
    rows = [{"i": i, "s": "x" * (i % 7)} for i in range(101)]
    ds = dataset(write_jsonl(tmp_path / "d.jsonl", rows), "jsonl")
    for k in (1, 7, 16):
        assert_shards_cover(read_shards(ds, k), rows)


def test_more_shards_than_rows(tmp_path):
    rows = [{"i": i} for i in range(3)]
    ds = dataset(write_jsonl(tmp_path / "d.jsonl", rows), "jsonl")
    shards = read_shards(ds, 8)
    assert [len(s) for s in shards] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert_shards_cover(shards, rows)


def test_empty_jsonl(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert read_shards(dataset(path, "jsonl"), 2) == [[], []]


def test_jsonl_invalid_utf8_is_bad_row(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    [rows] = read_shards(dataset(path, "jsonl"), 1)
    assert rows[0].value == {"a": 1}
    assert isinstance(rows[1].value, RowError) and f"{path}:2" in str(rows[1].value)


def test_changed_jsonl_after_indexing_raises(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"i": 0}, {"i": 1}])
    ds = dataset(path, "jsonl")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 2, index)
    with path.open("a") as f:
        f.write('{"i": 2}\n')
    with pytest.raises(ValueError, match="changed after it was indexed"):
        load_shard(index, ds, 2, 0)


# --------------------------------------------------------------------------- Parquet


@pytest.fixture
def parquet_dir(tmp_path) -> Path:
    """Three files of 10, 7 and 13 rows, four rows per row group."""
    d = tmp_path / "pq"
    d.mkdir()
    start = 0
    for part, n in enumerate([10, 7, 13]):
        table = pa.table(
            {
                "id": list(range(start, start + n)),
                "text": [f"row {i}" for i in range(start, start + n)],
                "tags": [[f"t{i}"] * (i % 3) for i in range(start, start + n)],
            }
        )
        pq.write_table(table, d / f"part-{part}.parquet", row_group_size=4)
        start += n
    (d / "README.txt").write_text("not data")
    return d


def pandas_rows(files) -> list[dict]:
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    return [{"id": int(r["id"]), "text": r["text"], "tags": list(r["tags"])} for r in df.to_dict("records")]


def test_parquet_fixture_has_several_row_groups(parquet_dir):
    assert pq.ParquetFile(parquet_dir / "part-0.parquet").num_row_groups == 3


@pytest.mark.parametrize("k", [1, 3, 4, 7, 30, 40])
def test_parquet_directory_shards_match_pandas(parquet_dir, k):
    expected = pandas_rows(sorted(parquet_dir.glob("*.parquet")))
    assert len(expected) == 30
    assert expected[10]["id"] == 10  # files are read in name order
    assert_shards_cover(read_shards(dataset(parquet_dir, "parquet"), k), expected)


def test_parquet_glob(parquet_dir):
    (parquet_dir / "other.parquet").write_bytes((parquet_dir / "part-0.parquet").read_bytes())
    ds = dataset(parquet_dir / "part-[12].parquet", "parquet")
    expected = pandas_rows([parquet_dir / "part-1.parquet", parquet_dir / "part-2.parquet"])
    assert [f["rows"] for f in write_index(ds, 1, parquet_dir / "i.index.json")["files"]] == [7, 13]
    assert_shards_cover(read_shards(ds, 3), expected)


def test_parquet_single_file(parquet_dir):
    path = parquet_dir / "part-2.parquet"
    assert_shards_cover(read_shards(dataset(path, "parquet"), 5), pandas_rows([path]))


def test_parquet_nothing_there(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_index(dataset(tmp_path / "none-*.parquet", "parquet"), 1, tmp_path / "i.index.json")


def test_changed_parquet_after_indexing_raises(parquet_dir, tmp_path):
    ds = dataset(parquet_dir, "parquet")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 2, index)
    pq.write_table(pa.table({"id": [1]}), parquet_dir / "part-3.parquet")
    with pytest.raises(ValueError, match="changed after it was indexed"):
        load_shard(index, ds, 2, 1)


# --------------------------------------------------------------------------- loadable (save_to_disk)


ROWS = [{"id": i, "text": f"t{i}", "meta": {"n": i * i}} for i in range(11)]


def test_loadable_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    ds = dataset(tmp_path / "hf", "loadable")
    for k in (1, 3, 16):
        assert_shards_cover(read_shards(ds, k), ROWS)  # also: reading leaves the directory unchanged


def test_loadable_dataset_dict_needs_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])})
    dd.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"set loading_params\.datasets\[0\]\.split"):
        write_index(dataset(tmp_path / "hf", "loadable"), 1, tmp_path / "i.index.json")
    with pytest.raises(ValueError, match="no split 'validation'"):
        write_index(dataset(tmp_path / "hf", "loadable", split="validation"), 1, tmp_path / "i.index.json")
    assert_shards_cover(read_shards(dataset(tmp_path / "hf", "loadable", split="test"), 3), ROWS[:2])
    assert_shards_cover(read_shards(dataset(tmp_path / "hf", "loadable", split="train"), 2), ROWS)


def test_loadable_dataset_dict_with_one_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
    assert_shards_cover(read_shards(dataset(tmp_path / "hf", "loadable"), 2), ROWS)


def test_changed_loadable_after_indexing_raises(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    ds = dataset(tmp_path / "hf", "loadable")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 1, index)
    datasets.Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "hf2"))
    for f in (tmp_path / "hf2").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="changed after it was indexed"):
        load_shard(index, ds, 1, 0)


# --------------------------------------------------------------------------- writers


def records(start: int, stop: int) -> list[dict]:
    return [{"source_index": i, "text": f"r{i}", "n": i * 10} for i in range(start, stop)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_part_is_complete_and_leaves_no_temp_files(tmp_path, fmt):
    (tmp_path / "shard_0").mkdir()
    write_part(tmp_path / "shard_0" / f"part-00000.{fmt}", records(0, 2), fmt)
    write_part(tmp_path / "shard_0" / f"part-00001.{fmt}", records(2, 5), fmt)
    assert names(tmp_path / "shard_0") == [f"part-00000.{fmt}", f"part-00001.{fmt}"]
    assert read_parts(tmp_path / "shard_0", fmt).to_pylist() == records(0, 5)


def test_failed_parquet_part_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "s").mkdir()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_part(tmp_path / "s" / "part-00000.parquet", [{"a": 1}, {"a": "one"}], "parquet")
    assert names(tmp_path / "s") == []


def test_read_parts_without_parts_is_none(tmp_path):
    (tmp_path / "s").mkdir()
    assert read_parts(tmp_path / "s", "parquet") is None


def test_atomic_write_json(tmp_path):
    atomic_write_json(tmp_path / "d" / "status.json", {"status": "success", "n": 1})
    atomic_write_json(tmp_path / "d" / "status.json", {"status": "failed"})
    assert names(tmp_path / "d") == ["status.json"]
    assert json.loads((tmp_path / "d" / "status.json").read_text()) == {"status": "failed"}


# --------------------------------------------------------------------------- merge


def test_merge_refuses_when_a_status_is_missing(tmp_path):
    cfg, ds = merge_config(tmp_path, 3)
    finish_shard(cfg, ds, 0, records(0, 3))
    finish_shard(cfg, ds, 2, records(5, 7))
    with pytest.raises(MergeRefused, match=r"shard\(s\) \[1\] of 3 are not complete"):
        merge_dataset(cfg, ds)
    assert not (Path(ds.output_dir) / "merged").exists()


@pytest.mark.parametrize("status, num_shards", [("failed", None), ("running", None), ("success", 5)])
def test_merge_refuses_unsuccessful_or_foreign_status(tmp_path, status, num_shards):
    cfg, ds = merge_config(tmp_path, 2)
    finish_shard(cfg, ds, 0, records(0, 2))
    finish_shard(cfg, ds, 1, records(2, 4), status=status, num_shards=num_shards)
    with pytest.raises(MergeRefused, match=r"\[1\]"):
        merge_dataset(cfg, ds)


def test_merge_in_source_order(tmp_path):
    import datasets

    cfg, ds = merge_config(tmp_path, 4)
    # written out of order; shard 2 wrote nothing (all its rows failed)
    finish_shard(cfg, ds, 3, records(8, 11))
    finish_shard(cfg, ds, 0, records(0, 5))
    finish_shard(cfg, ds, 2, [])
    finish_shard(cfg, ds, 1, records(5, 8))
    merged = Path(ds.output_dir) / "merged"
    merged.mkdir()
    (merged / "part-00099.parquet").write_text("stale")

    result = merge_dataset(cfg, ds)

    assert result["rows"] == 11 and result["merged_dir"] == str(merged)
    assert "part-00099.parquet" not in names(merged)
    assert not any(n.startswith(".") for n in names(merged.parent))  # no temp dirs left
    df = pd.read_parquet(merged)
    assert df["source_index"].tolist() == list(range(11))
    assert df.to_dict("records") == records(0, 11)
    hf = datasets.load_dataset("parquet", data_dir=str(merged), cache_dir=str(tmp_path / "hf_cache"))["train"]
    assert hf["source_index"] == list(range(11))
    assert hf["text"] == [f"r{i}" for i in range(11)]


def test_merge_jsonl(tmp_path):
    cfg, ds = merge_config(tmp_path, 2, fmt="jsonl")
    finish_shard(cfg, ds, 0, records(0, 3))
    finish_shard(cfg, ds, 1, records(3, 4))
    assert merge_dataset(cfg, ds)["rows"] == 4
    merged = Path(ds.output_dir) / "merged"
    lines = [json.loads(line) for p in sorted(merged.glob("part-*.jsonl")) for line in p.read_text().splitlines()]
    assert lines == records(0, 4)


def test_merge_refuses_mixed_up_source_order(tmp_path):
    cfg, ds = merge_config(tmp_path, 2)
    finish_shard(cfg, ds, 0, records(3, 6))
    finish_shard(cfg, ds, 1, records(0, 3))
    with pytest.raises(MergeRefused, match="in the wrong shard"):
        merge_dataset(cfg, ds)
    assert not (Path(ds.output_dir) / "merged").exists()


def test_merge_sorts_parts_written_in_completion_order_and_refuses_duplicates(tmp_path):
    cfg, ds = merge_config(tmp_path, 1)
    finish_shard(cfg, ds, 0, [*records(2, 4), *records(0, 2)])
    assert merge_dataset(cfg, ds)["rows"] == 4
    assert pd.read_parquet(Path(ds.output_dir) / "merged")["source_index"].tolist() == [0, 1, 2, 3]
    finish_shard(cfg, ds, 0, [*records(0, 2), *records(1, 3)])
    with pytest.raises(MergeRefused, match="appears twice"):
        merge_dataset(cfg, ds)


def test_merge_unifies_column_types_across_shards(tmp_path):
    import datasets

    cfg, ds = merge_config(tmp_path, 3)
    # each shard infers its own types: all-null (type null), int, float, a column only one shard has
    finish_shard(cfg, ds, 0, [{"source_index": 0, "answer": None, "n": 1}])
    finish_shard(cfg, ds, 1, [{"source_index": 1, "answer": "x", "n": 2.5}])
    finish_shard(cfg, ds, 2, [{"source_index": 2, "answer": "y", "extra": {"k": 1}}])
    assert merge_dataset(cfg, ds)["rows"] == 3
    merged = Path(ds.output_dir) / "merged"
    expected = [
        {"source_index": 0, "answer": None, "n": 1.0, "extra": None},
        {"source_index": 1, "answer": "x", "n": 2.5, "extra": None},
        {"source_index": 2, "answer": "y", "n": None, "extra": {"k": 1}},
    ]
    assert pq.read_table(merged).to_pylist() == expected
    assert pd.read_parquet(merged)["answer"].tolist()[1:] == ["x", "y"]
    hf = datasets.load_dataset("parquet", data_dir=str(merged), cache_dir=str(tmp_path / "hf_cache"))["train"]
    assert hf.to_list() == expected


def test_merge_stores_incompatible_column_types_as_json(tmp_path):
    cfg, ds = merge_config(tmp_path, 2)
    finish_shard(cfg, ds, 0, [{"source_index": 0, "answer": 1}])
    finish_shard(cfg, ds, 1, [{"source_index": 1, "answer": "one"}])
    assert merge_dataset(cfg, ds)["rows"] == 2
    merged = pq.read_table(Path(ds.output_dir) / "merged")
    assert merged.schema.field("answer").metadata == {b"mirageflow.encoding": b"json"}
    assert [json.loads(v) for v in merged.column("answer").to_pylist()] == [1, "one"]
