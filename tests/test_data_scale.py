"""What reading a dataset costs (issue 37): a Parquet shard decodes only its columns and the
part of a row group it needs, the index reads each file once (a Parquet file's footer only),
and a shard job never hashes a whole dataset file (it trusts what the index or the driver
recorded). Costs are bytes read by this process (``/proc/self/io``), never times."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mirageflow.config import DatasetConfig
from mirageflow.config.types import InputVar
from mirageflow.data import readers
from mirageflow.data.readers import SHARD_START, load_shard, read_shard, write_index
from mirageflow.data.sharding import shard_range
from mirageflow.state.inputs import ContentCache, dataset_changed

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="bytes read are counted by /proc/self/io")

ROWS = 20_000
BLOB = 1000  # bytes of the wide column of each row (random: it does not compress)


def bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def dataset(path, kind: str) -> DatasetConfig:
    return DatasetConfig(index=0, path=str(path), type=kind, output_dir="unused", output_format="parquet", split=None)


@pytest.fixture(scope="module")
def one_group(tmp_path_factory) -> Path:
    """20k rows in ONE row group (what pyarrow.parquet.write_table makes up to 1Mi rows): a
    narrow column ``q`` and a wide incompressible column ``blob`` (~20 MB)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("pq") / "one.parquet"
    table = pa.table({"q": [f"question {i}" for i in range(ROWS)], "blob": [rng.randbytes(BLOB // 2).hex() for _ in range(ROWS)]})
    pq.write_table(table, path, row_group_size=ROWS)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    return path


def read_counted(ds, piece, columns) -> tuple[list, int]:
    before = bytes_read()
    rows = list(read_shard(ds, piece, columns=columns))
    return rows, bytes_read() - before


# --------------------------------------------------------------------------- a Parquet shard's read


def test_a_parquet_shard_reads_only_its_columns_and_rows_of_a_one_group_file(one_group, tmp_path):
    ds = dataset(one_group, "parquet")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 20, index)
    size = one_group.stat().st_size
    first = load_shard(index, ds, 20, 0)  # rows 0..999 of the group's 20,000

    rows, read = read_counted(ds, first, frozenset({"q"}))
    assert [r.value for r in rows] == [{"q": f"question {i}"} for i in range(1000)]  # the wide column is not decoded
    assert read < size / 20, f"read {read} bytes of a {size}-byte file for one narrow column"

    rows, read = read_counted(ds, first, None)  # every column (remove_columns: false)
    assert sorted(rows[0].value) == ["blob", "q"] and len(rows) == 1000
    assert read < size / 4, f"read {read} bytes of a {size}-byte file for the first 1/20 of its rows"

    late = load_shard(index, ds, 20, 19)  # the last rows: the group is streamed up to them, never held
    rows, _ = read_counted(ds, late, frozenset({"q"}))
    assert [r.index for r in rows] == list(range(19_000, 20_000))
    assert rows[-1].value == {"q": "question 19999"}


@pytest.mark.parametrize("batch", [3, 7, 1024])
def test_parquet_rows_across_batches_and_row_groups_are_exact(tmp_path, monkeypatch, batch):
    monkeypatch.setattr(readers, "PARQUET_BATCH_ROWS", batch)
    n = 97
    path = tmp_path / "g.parquet"
    pq.write_table(pa.table({"a": list(range(n)), "b": [str(i) for i in range(n)]}), path, row_group_size=10)
    ds = dataset(path, "parquet")
    files = [{"path": str(path), "rows": n}]
    for shards in (1, 4, 9, 13):
        for s in range(shards):
            start, stop = shard_range(n, shards, s)
            piece = readers.ShardSlice(start, stop, files=files)
            got = [(r.index, r.value) for r in read_shard(ds, piece, skip=lambda i: i % 5 == 0, columns=frozenset({"a"}))]
            assert got == [(i, {"a": i}) for i in range(start, stop) if i % 5]


def test_columns_read_follow_the_pipeline():
    from mirageflow.prompts.templates import columns_read

    def var(key):
        return InputVar(name="v", key=key, has_default=False, default=None)

    assert columns_read([var("conv[0].text"), var("meta.lang || 'en'")], True, ("id",)) == {"conv", "meta", "id"}
    assert columns_read([var("question")], False) is None  # records keep the row: every column
    assert columns_read([var("keys(@)")], True) is None  # reads the whole row
    assert columns_read([var("*.text")], True) is None


def test_check_warns_about_row_groups_far_larger_than_a_shard(one_group, tmp_path):
    from mirageflow.data.readers import row_group_warnings

    ds = dataset(one_group, "parquet")
    (warning,) = row_group_warnings(ds, 200)
    assert str(one_group) in warning and "20,000 rows" in warning and "row_group_size=100" in warning
    small = tmp_path / "small.parquet"
    pq.write_table(pq.read_table(one_group), small, row_group_size=1000)
    assert row_group_warnings(dataset(small, "parquet"), 200) == []
    assert row_group_warnings(ds, 2) == []  # a shard of 10,000 rows: the group is twice a shard


# --------------------------------------------------------------------------- the index reads each file once


def test_a_jsonl_index_reads_the_file_once(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(b'{"q": "%d", "pad": "%s"}\n' % (i, b"x" * 200) for i in range(20_000)))
    size = path.stat().st_size
    before = bytes_read()
    header = write_index(dataset(path, "jsonl"), 200, tmp_path / "dataset_0.index.json")
    read = bytes_read() - before
    assert header["rows"] == 20_000
    assert header["content"][str(path)][1] == hashlib.sha256(path.read_bytes()).hexdigest()  # the identity, in the same pass
    assert size <= read < size * 1.1, f"read {read} bytes to index a {size}-byte file"


@pytest.mark.parametrize("blank_rate", [0, 0.00003, 0.05])
def test_one_pass_shard_starts_equal_a_line_by_line_count(tmp_path, blank_rate):
    """Blank and whitespace lines (none, in a few chunks, everywhere), CRLF, no final newline,
    and more rows than the pass keeps marks for (every other mark dropped, twice): each start
    is the row's byte and line."""
    rng = random.Random(1)
    lines = []
    for i in range(140_000):
        lines.append(b'{"i": %d, "pad": "%s"}' % (i, b"x" * rng.randint(0, 20)) + rng.choice([b"\n", b"\r\n"]))
        if rng.random() < blank_rate:
            lines.append(rng.choice([b"\n", b"  \n", b"\t\r\n"]))
    path = tmp_path / "messy.jsonl"
    path.write_bytes(b"".join(lines).rstrip(b"\r\n"))
    starts, row, offset = {}, 0, 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                starts[row] = (offset, lineno)
                row += 1
            offset += len(line)
    for shards in (1, 7, 300, 140_003):
        rows, table, _ = readers.index_jsonl(str(path), shards)
        assert rows == 140_000
        expected = [starts.get(shard_range(rows, shards, s)[0], (offset, 0)) for s in range(shards)]
        got = [SHARD_START.unpack_from(table, s * SHARD_START.size) for s in range(shards)]
        assert got == expected


def test_a_parquet_index_reads_footers_only(one_group, tmp_path):
    ds = dataset(one_group, "parquet")
    before = bytes_read()
    header = write_index(ds, 20, tmp_path / "dataset_0.index.json")
    read = bytes_read() - before
    assert header["rows"] == ROWS and header["files"] == [{"path": str(one_group), "rows": ROWS}]
    assert read < 1 << 20, f"read {read} bytes of a {one_group.stat().st_size}-byte file"
    key, identity = header["content"][str(one_group)]
    assert identity.startswith("parquet-footer-sha256:") and key[1] == one_group.stat().st_size


def test_a_parquet_edit_with_an_old_mtime_is_seen_by_its_footer(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["a", "b", "c"]}), path)
    ds = dataset(path, "parquet")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 1, index)
    st = path.stat()
    pq.write_table(pa.table({"q": ["a", "b", "d"]}), path)  # the same size, an edited value
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime (cp -p, rsync -a)
    assert path.stat().st_size == st.st_size
    assert "changed since it was indexed" in dataset_changed(ds, ContentCache(tmp_path / "content.json"), index)
    with pytest.raises(ValueError, match="changed since it was indexed"):
        load_shard(index, ds, 1, 0)


# --------------------------------------------------------------------------- jobs trust what was recorded


def test_a_shard_job_never_hashes_a_touched_dataset_file(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(b'{"q": "%d", "pad": "%s"}\n' % (i, b"x" * 200) for i in range(20_000)))
    ds = dataset(path, "jsonl")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 200, index)
    os.utime(path)  # touch: same bytes, a new mtime
    size = path.stat().st_size

    before = bytes_read()
    with pytest.raises(ValueError, match="driver"):  # nothing recorded for this version: the job refuses, it does not hash
        load_shard(index, ds, 200, 150)
    assert bytes_read() - before < size / 10

    cache = ContentCache(tmp_path / "content.json")  # the driver at DAG build: hashes it once, keeps it
    assert dataset_changed(ds, cache, index) is None
    cache.save()
    before = bytes_read()
    for shard in (0, 150, 199):  # every job after it trusts what the driver recorded
        assert load_shard(index, ds, 200, shard).stop == shard_range(20_000, 200, shard)[1]
    assert bytes_read() - before < size / 10


def test_a_touched_parquet_file_is_checked_by_its_footer_in_the_job(one_group, tmp_path):
    ds = dataset(one_group, "parquet")
    index = tmp_path / "dataset_0.index.json"
    write_index(ds, 20, index)
    os.utime(one_group)
    before = bytes_read()
    assert load_shard(index, ds, 20, 19).start == 19_000  # no driver record needed: the footer is its identity
    assert bytes_read() - before < 1 << 20


def test_mmirage_check_prints_the_row_group_warning(one_group, tmp_path, tiny_model, monkeypatch, capsys):
    import yaml
    from fakes.configs import pipeline_config

    from mirageflow import cli

    config = pipeline_config(
        one_group, model=tiny_model, num_shards=200, dataset={"type": "Parquet"}, processor={"backend": "transformers"}
    )
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "--config", "pipeline.yaml"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert f"warning: loading_params.datasets[0]: {one_group} has row groups of up to 20,000 rows" in out
    assert "row_group_size=100" in out


def test_a_shard_reads_only_the_columns_its_pipeline_uses(tmp_path):
    """A column no input or preserved column names is never decoded: here one that Python
    cannot hold (a timestamp past year 9999) costs no row, while with remove_columns false
    (records keep the row) it is read and each row is a named row error."""
    from fakes.configs import pipeline_config
    from fakes.engines import ScriptedEngine

    from mirageflow.config import load_config
    from mirageflow.data.writers import read_parts
    from mirageflow.shard import ShardFailed
    from mirageflow.shard.runner import index_datasets, run_shard

    data = tmp_path / "in.parquet"
    table = pa.table({"q": ["x", "y"], "id": [7, 8], "when": pa.array([2**40, 2**40], type=pa.timestamp("s"))})
    pq.write_table(table, data)

    def run(root, remove_columns):
        cfg = load_config(pipeline_config(
            data, dataset={"type": "Parquet"}, state_dir=root / "state", output_dir=root / "out",
            processing={"remove_columns": remove_columns, "preserve_columns": ["id"] if remove_columns else [],
                        "output_schema": {"a": "{{ a }}"}},
            shard_params={"max_error_rate": 1.0},
        ), environ={})  # fmt: skip
        index_datasets(cfg)
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda prompt: prompt.rsplit(":", 1)[1].upper()))
        return read_parts(root / "out" / "shard_0", "parquet").to_pylist()

    assert run(tmp_path / "used", True) == [{"id": 7, "a": "X", "source_index": 0}, {"id": 8, "a": "Y", "source_index": 1}]
    with pytest.raises(ShardFailed, match="bad_row: 2"):
        run(tmp_path / "kept", False)
    errors = [json.loads(line) for line in (tmp_path / "kept" / "state" / "shard_0" / "errors.jsonl").read_text().splitlines()]
    assert [e["error"] for e in errors] == ["bad_row", "bad_row"] and "cannot be converted" in errors[0]["message"]


def test_a_hugging_face_shard_reads_only_its_columns(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"q": ["a", "b", "c"], "x": [1, 2, 3]}).save_to_disk(str(tmp_path / "hf"))
    ds = dataset(tmp_path / "hf", "loadable")
    assert [r.value for r in read_shard(ds, readers.ShardSlice(1, 3), columns=frozenset({"x"}))] == [{"x": 2}, {"x": 3}]
    assert [r.value for r in read_shard(ds, readers.ShardSlice(0, 1))] == [{"q": "a", "x": 1}]


# --------------------------------------------------------------------------- shards on row-group boundaries


def test_row_group_starts_are_the_group_starts_nearest_to_mmirages():
    from mirageflow.data.sharding import row_group_starts

    assert row_group_starts([100] * 10, 4) == [0, 200, 500, 700]  # ideal 0, 250, 500, 750: ties go to the earlier start
    assert row_group_starts([100] * 10, 10) == [shard_range(1000, 10, s)[0] for s in range(10)]  # groups of a shard's size
    assert row_group_starts([1000], 3) == [0, 0, 1000]  # one group: one shard has it, the others are empty
    assert row_group_starts([10, 500, 10, 10], 4) == [0, 10, 510, 510]  # ideal 266 and 398: both nearest 510 (one empty)


def test_a_parquet_dataset_sharded_on_row_groups_reads_every_row_once_and_no_group_twice(tmp_path, monkeypatch):
    """shard_boundaries: row_groups: each shard starts at a row group's first row, so no shard
    decodes rows of a group only to skip them; together the shards read every row once."""
    files = []
    for k, sizes in enumerate(([100] * 4, [50, 150, 100])):  # two files, groups of unequal sizes
        path = tmp_path / f"part-{k}.parquet"
        start = sum(sum(s) for s in ([100] * 4, [50, 150, 100])[:k])
        writer = pq.ParquetWriter(path, pa.schema([("a", pa.int64())]))
        for n in sizes:
            writer.write_table(pa.table({"a": list(range(start, start + n))}))
            start += n
        writer.close()
        files.append(path)
    ds = DatasetConfig(index=0, path=str(tmp_path), type="parquet", output_dir="unused", output_format="parquet", split=None,
                       shard_boundaries="row_groups")  # fmt: skip
    index = tmp_path.parent / "dataset_0.index.json"
    write_index(ds, 3, index)
    pieces = [load_shard(index, ds, 3, s) for s in range(3)]
    edges = {0, 100, 200, 300, 400, 450, 600, 700}
    assert [p.start for p in pieces] == [0, 200, 450] and all(p.start in edges for p in pieces)
    decoded = []
    real_iter = pq.ParquetFile.iter_batches

    def counting(self, *args, row_groups=None, **kwargs):
        for batch in real_iter(self, *args, row_groups=row_groups, **kwargs):
            decoded.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)
    got = [r.value["a"] for p in pieces for r in read_shard(ds, p, columns=frozenset({"a"}))]
    assert got == list(range(700)) and sum(decoded) == 700  # every row once, none decoded to be skipped

    rows_ds = dataset(tmp_path, "parquet")  # the default, MMIRAGE's formula: the index says which it was built for
    with pytest.raises(ValueError, match="built for shard_boundaries: row_groups"):
        load_shard(index, rows_ds, 3, 0)
    assert "shard_boundaries" in (dataset_changed(rows_ds, ContentCache(tmp_path / "c.json"), index) or "")


def test_row_group_boundaries_are_refused_on_a_dataset_that_is_not_parquet(tmp_path):
    import yaml
    from fakes.configs import pipeline_config
    from mirageflow.config import load_config
    from mirageflow.config.loading import ConfigError

    data = tmp_path / "in.jsonl"
    data.write_text('{"q": "x"}\n')
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(pipeline_config(data, dataset={"shard_boundaries": "row_groups"})))
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.shard_boundaries: row_groups needs a Parquet dataset"):
        load_config(config, environ={})
