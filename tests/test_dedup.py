"""Deduplication after merge (deduplication_params, mirageflow/data/dedup.py).

Units of the exact and MinHash/LSH passes, the deduplicated copy of a merged JSONL (line
bytes kept) and Parquet (schema and field metadata kept) output, hostile records (no text
field, null, a number, a JSON-encoded column), the accounting checks, the config checks at
load, and one run through `snakemake` (openai backend against the fake server) with the
counts in the report and a parameter change that reruns only the dedup rule.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_workflow, shard_jobs
from fakes.configs import pipeline_config
from fakes.fake_http import FakeServer

from mirageflow.config import ConfigError, load_config
from mirageflow.config.types import DedupParams
from mirageflow.data.dedup import (
    DedupError,
    normalize,
    read_dedup_counts,
    remove_stale_dedup_outputs,
    shingles,
)
from mirageflow.data.dedup_stages import dedup_dataset
from mirageflow.data.writers import is_json_field, records_table, write_merged

pytestmark = pytest.mark.usefixtures("no_proxy")

BASE = "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence near the barn."
NEAR = BASE.replace("farmer", "farmers")  # one character more: Jaccard of 5-shingles ~0.95
OTHER = "Completely unrelated sentence about databases, indexes and the cost of random reads on spinning disks."


def params(**kw) -> DedupParams:
    base = dict(enabled=True, exact=True, fuzzy=True, text_field="text", threshold=0.85, num_perm=128, shingle_size=5)
    return DedupParams(**{**base, **kw})


def run(texts: list, partitions: int = 2, **kw) -> list:
    """Each text's fate through every stage (data/dedup_stages.py): None (kept), or (kind, the
    kept row it duplicates, similarity); the texts in two merged JSONL parts."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, ds = dataset(Path(tmp), "jsonl")
        lines = [json.dumps({"text": t, "source_index": i}).encode() + b"\n" for i, t in enumerate(texts)]
        half = len(lines) // 2
        write_merged([lines[:half], lines[half:]], Path(ds.output_dir) / "merged", "jsonl")
        write_manifest(cfg, len(lines))
        dedup_dataset(cfg, ds, params(**kw), Path(tmp) / "c.json", Path(tmp) / "r.jsonl", partitions=partitions)
        removed = {r["row"]: r for r in map(json.loads, (Path(tmp) / "r.jsonl").read_text().splitlines())}
    return [
        (removed[i]["kind"], removed[i]["duplicate_of_row"], removed[i].get("similarity")) if i in removed else None
        for i in range(len(texts))
    ]


# --------------------------------------------------------------------------- the passes


def test_normalisation_and_shingles():
    assert normalize("  Hello\t\nWORLD  again ") == "hello world again"
    assert shingles("abcdef", 5) == {b"abcde", b"bcdef"}
    assert shingles("abc", 5) == {b"abc"}  # shorter than a shingle: one shingle
    assert shingles("é" * 5, 5) == {"ééééé".encode()}


def test_exact_duplicates_keep_the_first_and_name_it():
    out = run([BASE, OTHER, "  " + BASE.upper() + "\n", BASE], fuzzy=False)
    assert out == [None, None, ("exact", 0, None), ("exact", 0, None)]


def test_near_duplicates_are_found_by_minhash_and_keep_the_first():
    out = run([OTHER, BASE, NEAR, NEAR + "!"])
    assert out[:2] == [None, None]
    assert out[2][:2] == ("near", 1) and 0.85 <= out[2][2] < 1  # true Jaccard 0.915
    # NEAR was removed, so never indexed: NEAR + "!" (0.93 to NEAR, 0.91 to BASE) names BASE
    assert out[3][:2] == ("near", 1)


def test_exact_pass_comes_first_and_fuzzy_alone_also_catches_exact_copies():
    assert run([BASE, BASE])[1] == ("exact", 0, None)
    fuzzy_only = run([BASE, BASE], exact=False)[1]
    assert fuzzy_only[:2] == ("near", 0) and fuzzy_only[2] == 1.0


def test_threshold_one_keeps_near_duplicates_and_a_low_threshold_removes_them():
    assert run([BASE, NEAR], threshold=1.0, exact=False) == [None, None]
    assert run([BASE, BASE.upper()], threshold=1.0, exact=False)[1] == ("near", 0, 1.0)  # equal signatures
    assert run([BASE, NEAR], threshold=0.5)[1][0] == "near"
    assert run([BASE, OTHER], threshold=0.5) == [None, None]  # unrelated texts are not LSH matches


def test_the_result_is_deterministic():
    texts = [BASE, NEAR, OTHER, OTHER.lower(), NEAR + "!", "short", "shorts"] * 3
    assert run(texts) == run(texts)


# --------------------------------------------------------------------------- datasets


def dataset(tmp_path: Path, fmt: str):
    cfg = SimpleNamespace(state_dir=str(tmp_path / "state"))
    ds = SimpleNamespace(index=0, path="in.jsonl", output_dir=str(tmp_path / "out"), output_format=fmt)
    return cfg, ds


def write_manifest(cfg, rows: int) -> None:
    p = Path(cfg.state_dir) / "merged" / "dataset_0.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"rows": rows}))


def test_jsonl_keeps_line_bytes_order_and_rows_without_text(tmp_path):
    cfg, ds = dataset(tmp_path, "jsonl")
    lines = [
        '{"text": "' + BASE + '", "n": 1, "source_index": 0}\n',
        '{"n":2,   "text": "' + BASE.upper() + '","source_index": 1}\n',  # odd spacing: kept as is when kept
        '{"text": "caf\\u00e9 \u00e9t\u00e9", "source_index": 2}\n',
        '{"n": 3, "source_index": 3}\n',  # no text field
        '{"text": null, "source_index": 4}\n',
        '{"text": 12345, "source_index": 5}\n',
        '{"text": 12345, "source_index": 6}\n',  # not text: never compared, so kept too
        '{"text": "' + NEAR + '", "source_index": 7}\n',
        '{"text": "' + OTHER + '", "source_index": 8}\n',
    ]
    write_merged([[ln.encode() for ln in lines[:4]], [ln.encode() for ln in lines[4:]]], Path(ds.output_dir) / "merged", "jsonl")
    write_manifest(cfg, len(lines))
    counts = dedup_dataset(cfg, ds, params(), tmp_path / "state/dedup/dataset_0.json", tmp_path / "state/dedup/dataset_0.removed.jsonl")

    out = sorted((Path(ds.output_dir) / "deduplicated").glob("part-*.jsonl"))
    assert [p.name for p in out] == ["part-00000.jsonl", "part-00001.jsonl"]
    kept = b"".join(p.read_bytes() for p in out)
    assert kept == "".join(lines[i] for i in (0, 2, 3, 4, 5, 6, 8)).encode()
    assert {k: counts[k] for k in ("rows_in", "exact_duplicates_removed", "near_duplicates_removed", "rows_out", "rows_without_text")} == {
        "rows_in": 9, "exact_duplicates_removed": 1, "near_duplicates_removed": 1, "rows_out": 7, "rows_without_text": 4,
    }  # fmt: skip
    removed = [json.loads(x) for x in (tmp_path / "state/dedup/dataset_0.removed.jsonl").read_text().splitlines()]
    assert removed[0] == {"row": 1, "source_index": 1, "kind": "exact", "duplicate_of_row": 0, "duplicate_of": 0}
    assert {k: removed[1][k] for k in ("row", "source_index", "kind", "duplicate_of_row", "duplicate_of")} == {
        "row": 7, "source_index": 7, "kind": "near", "duplicate_of_row": 0, "duplicate_of": 0,
    }  # fmt: skip
    assert 0.85 <= removed[1]["similarity"] < 1
    assert json.loads((tmp_path / "state/dedup/dataset_0.json").read_text()) == counts
    assert read_dedup_counts(cfg.state_dir) == [{"counts_file": str(tmp_path / "state/dedup/dataset_0.json"), **counts}]


def test_parquet_keeps_schema_field_metadata_and_json_encoded_text(tmp_path):
    cfg, ds = dataset(tmp_path, "parquet")
    # "mixed" holds a string and a number: stored as JSON text (mirageflow.encoding: json)
    records = [
        {"text": BASE, "mixed": "a", "source_index": 0},
        {"text": NEAR, "mixed": 2, "source_index": 1},
        {"text": OTHER, "mixed": "c", "source_index": 2},
    ]
    tables = [records_table(records[:2]), records_table(records[2:])]
    write_merged(tables, Path(ds.output_dir) / "merged", "parquet")
    write_manifest(cfg, 3)
    dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")
    merged_schema = pq.read_schema(sorted((Path(ds.output_dir) / "merged").glob("*.parquet"))[0])
    parts = sorted((Path(ds.output_dir) / "deduplicated").glob("*.parquet"))
    assert [pq.read_schema(p) for p in parts][0].equals(merged_schema, check_metadata=True)
    assert is_json_field(pq.read_schema(parts[0]).field("mixed"))
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    assert table.column("source_index").to_pylist() == [0, 2]

    # the text field itself JSON-encoded: values are compared as what they decode to
    cfg, ds = dataset(tmp_path / "b", "parquet")
    records = [{"text": BASE, "source_index": 0}, {"text": 7, "source_index": 1}, {"text": BASE, "source_index": 2}]
    table = records_table(records)
    assert is_json_field(table.schema.field("text"))
    write_merged([table], Path(ds.output_dir) / "merged", "parquet")
    write_manifest(cfg, 3)
    counts = dedup_dataset(cfg, ds, params(), tmp_path / "b/c.json", tmp_path / "b/r.jsonl")
    assert (counts["exact_duplicates_removed"], counts["rows_without_text"], counts["rows_out"]) == (1, 1, 2)


def test_samples_of_one_row_are_named_by_their_sample_index(tmp_path):
    cfg, ds = dataset(tmp_path, "jsonl")
    lines = [json.dumps({"text": t, "source_index": 0, "sample_index": k}).encode() + b"\n" for k, t in enumerate([BASE, OTHER, BASE])]
    write_merged([lines], Path(ds.output_dir) / "merged", "jsonl")
    write_manifest(cfg, 3)
    dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")
    [removed] = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert removed == {
        "row": 2,
        "source_index": 0,
        "kind": "exact",
        "duplicate_of_row": 0,
        "duplicate_of": 0,
        "sample_index": 2,
        "duplicate_of_sample": 0,
    }


def test_a_missing_text_column_keeps_every_row(tmp_path):
    cfg, ds = dataset(tmp_path, "parquet")
    write_merged(
        [pa.Table.from_pylist([{"a": 1, "source_index": 0}, {"a": 1, "source_index": 1}])], Path(ds.output_dir) / "merged", "parquet"
    )
    write_manifest(cfg, 2)
    counts = dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")
    assert (counts["rows_out"], counts["rows_without_text"]) == (2, 2)


def test_a_merged_output_that_does_not_match_its_manifest_is_refused_and_nothing_written(tmp_path):
    cfg, ds = dataset(tmp_path, "jsonl")
    write_merged([[b'{"text": "a", "source_index": 0}\n']], Path(ds.output_dir) / "merged", "jsonl")
    write_manifest(cfg, 2)
    with pytest.raises(DedupError, match=r"holds 1 records, its merge manifest .*dataset_0.json counts 2"):
        dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")
    assert not (Path(ds.output_dir) / "deduplicated").exists() and not (tmp_path / "c.json").exists()


def test_damaged_inputs_name_the_file(tmp_path):
    cfg, ds = dataset(tmp_path, "jsonl")
    with pytest.raises(DedupError, match="cannot read the merge manifest"):
        dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")
    write_manifest(cfg, 1)
    with pytest.raises(DedupError, match="no merged output"):
        dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")
    write_merged([[b"{not json\n"]], Path(ds.output_dir) / "merged", "jsonl")
    with pytest.raises(DedupError, match=r"part-00000.jsonl:1: not a JSON record"):
        dedup_dataset(cfg, ds, params(), tmp_path / "c.json", tmp_path / "r.jsonl")


# --------------------------------------------------------------------------- the stages against the single job


def hostile_records(seed: int) -> list[list]:
    """Merged parts of records: originals, exact copies (other case, spacing) and near copies
    (one word replaced) across parts, chains of near copies (A~B, B~C, A!~C: the single job
    keeps A and C), a part of one text repeated, empty parts, records without text."""
    import random

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(300)]
    originals = [" ".join(rng.choices(words, k=rng.randint(12, 40))) for _ in range(60)]
    chain = [" ".join(words[i : i + 30]) for i in range(0, 6)]  # each one word on from the last
    texts = []
    for i in range(240):
        r = rng.random()
        if r < 0.4:
            texts.append(rng.choice(originals))
        elif r < 0.55:
            texts.append("  " + rng.choice(originals).upper().replace(" ", "  ") + "\n")
        elif r < 0.8:
            w = rng.choice(originals).split()
            w[rng.randrange(len(w))] = "zebra"
            texts.append(" ".join(w))
        elif r < 0.9:
            texts.append(rng.choice(chain))
        else:
            # no text, not text, short texts; "aaaaaa" and "aaaaaaa": one shingle, equal signatures
            texts.append(rng.choice([None, 7, "short", "shorts", "aaaaaa", "aaaaaaa"]))
    records = [{"text": t, "source_index": i} if t is not None else {"source_index": i} for i, t in enumerate(texts)]
    same = [{"text": originals[0], "source_index": 1000 + i} for i in range(30)]  # all duplicates
    return [records[:70], [], records[70:150], same, [], records[150:]]


VARIANTS = [
    {},
    {"exact": False},
    {"fuzzy": False},
    {"threshold": 1.0},
    {"threshold": 1.0, "exact": False},
    {"threshold": 0.5, "num_perm": 32, "shingle_size": 3},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("partitions", [1, 3, 4])
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_the_stages_remove_what_the_single_job_removed(tmp_path, fmt, partitions, variant):
    from dedup_reference import reference

    p = params(**VARIANTS[variant])
    parts = hostile_records(seed=variant)
    cfg, ds = dataset(tmp_path, fmt)
    if fmt == "jsonl":
        items = [[json.dumps(r).encode() + b"\n" for r in part] for part in parts]
    else:
        items = [
            records_table(part) if part else pa.table({"text": pa.array([], pa.string()), "source_index": pa.array([], pa.int64())})
            for part in parts
        ]
    write_merged(items, Path(ds.output_dir) / "merged", fmt)
    everything = [r for part in parts for r in part]
    write_manifest(cfg, len(everything))
    counts = dedup_dataset(cfg, ds, p, tmp_path / "c.json", tmp_path / "r.jsonl", partitions=partitions)

    keep, removed_lines, expected = reference(everything, p)
    assert (tmp_path / "r.jsonl").read_bytes() == b"".join(removed_lines)
    assert (counts["exact_duplicates_removed"], counts["near_duplicates_removed"], counts["rows_without_text"]) == (
        expected["exact"], expected["near"], expected["rows_without_text"],
    )  # fmt: skip
    assert counts["near_duplicates_removed"] > 0 or not p.fuzzy
    out = sorted((Path(ds.output_dir) / "deduplicated").glob(f"part-*.{fmt}"))
    if fmt == "jsonl":
        kept = [json.loads(x) for path in out for x in path.read_text().splitlines()]
    else:
        kept = [r for path in out for r in pq.read_table(path).to_pylist()]
    assert [r["source_index"] for r in kept] == [r["source_index"] for r, k in zip(everything, keep) if k]
    # the parallel writers' parts are, byte for byte, what one writer of the kept records wrote
    marks = iter(keep)
    kept_items = []
    for item in items:
        mask = [next(marks) for _ in range(len(item) if fmt == "jsonl" else item.num_rows)]
        kept_items.append([x for x, k in zip(item, mask) if k] if fmt == "jsonl" else item.filter(pa.array(mask, pa.bool_())))
    write_merged(kept_items, tmp_path / "one_writer", fmt)
    assert [p.name for p in out] == [p.name for p in sorted((tmp_path / "one_writer").iterdir())]
    assert all(p.read_bytes() == (tmp_path / "one_writer" / p.name).read_bytes() for p in out)


# --------------------------------------------------------------------------- deduplicated/ written by parallel jobs


def staged(tmp_path: Path, fmt: str = "jsonl", partitions: int = 2):
    """Four merged parts (duplicates within and across them) through stages 1-3: (cfg, ds, params)."""
    from mirageflow.data.dedup_stages import write_decisions, write_pairs, write_signatures
    from mirageflow.state.layout import StateLayout

    cfg, ds = dataset(tmp_path, fmt)
    texts = [[BASE, OTHER], [BASE.upper(), "part one's own text, unlike the others"], [NEAR, OTHER + "  "], ["the last part's text", BASE]]
    rows = [[{"text": t, "source_index": 2 * i + j} for j, t in enumerate(part)] for i, part in enumerate(texts)]
    items = [[json.dumps(r).encode() + b"\n" for r in part] for part in rows] if fmt == "jsonl" else [records_table(x) for x in rows]
    write_merged(items, Path(ds.output_dir) / "merged", fmt)
    write_manifest(cfg, 8)
    p, paths = params(), StateLayout(cfg.state_dir)
    files = [paths.dedup_signatures(0, k) for k in range(partitions)]
    files[0]["meta"].parent.mkdir(parents=True, exist_ok=True)
    for k in range(partitions):
        write_signatures(Path(ds.output_dir) / "merged", fmt, p, partitions, k, files[k])
    for k in range(partitions):
        write_pairs(p, partitions, k, files, paths.dedup_edges(0, k))
    assert write_decisions(cfg, ds, p, partitions) == 4  # rows 2 (exact), 4 (near), 5 (exact), 7 (exact)
    return cfg, ds, p


def test_each_write_job_writes_its_own_parts_reading_only_them(tmp_path):
    from mirageflow.data.dedup_stages import write_kept

    cfg, ds, p = staged(tmp_path)
    out, staging = Path(ds.output_dir) / "deduplicated", Path(ds.output_dir) / ".deduplicated.parts"
    (Path(ds.output_dir) / "merged/part-00001.jsonl").write_bytes(b"{damaged\n{damaged\n")  # job 1's part: job 0 never reads it
    report = write_kept(cfg, ds, p, 2, 0)
    assert [(x["name"], x["rows_in"], x["rows_out"], x["removed"]) for x in report["parts"]] == [
        ("part-00000.jsonl", 2, 2, 0), ("part-00002.jsonl", 2, 0, 2),
    ]  # fmt: skip
    # the idents the removed list needs: its removed records, and its kept ones a removed record names
    assert sorted(row for row, _, _ in report["idents"]) == [0, 1, 2 << 32, (2 << 32) | 1]
    assert sorted(x.name for x in staging.iterdir()) == ["part-00000.jsonl", "part-00002.jsonl"] and not out.exists()
    with pytest.raises(DedupError, match=r"part-00001.jsonl:1: not a JSON record"):
        write_kept(cfg, ds, p, 2, 1)
    assert sorted(x.name for x in staging.iterdir()) == ["part-00000.jsonl", "part-00002.jsonl"]


def test_the_last_stage_puts_the_jobs_parts_in_place_and_can_run_again_alone(tmp_path):
    from mirageflow.data.dedup_stages import write_deduplicated, write_kept

    cfg, ds, p = staged(tmp_path)
    out, staging = Path(ds.output_dir) / "deduplicated", Path(ds.output_dir) / ".deduplicated.parts"
    out.mkdir(parents=True)
    (out / "part-00009.jsonl").write_bytes(b"an earlier run's\n")
    for job in (1, 0):
        write_kept(cfg, ds, p, 2, job)
    (staging / ".part-00003.jsonl.0123456789ab.tmp").write_bytes(b"a killed job's temp file\n")
    counts = write_deduplicated(cfg, ds, p, 2, tmp_path / "c.json", tmp_path / "r.jsonl")
    assert (counts["rows_in"], counts["rows_out"], counts["exact_duplicates_removed"], counts["near_duplicates_removed"]) == (8, 4, 3, 1)
    assert not staging.exists() and sorted(x.name for x in out.iterdir()) == [f"part-0000{i}.jsonl" for i in range(4)]
    kept = [json.loads(x)["source_index"] for part in sorted(out.iterdir()) for x in part.read_text().splitlines()]
    assert kept == [0, 1, 3, 6]
    removed = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["row"], r["source_index"], r["kind"], r["duplicate_of"]) for r in removed] == [
        (2, 2, "exact", 0), (4, 4, "near", 0), (5, 5, "exact", 1), (7, 7, "exact", 0),
    ]  # fmt: skip
    before = {x.name: x.read_bytes() for x in out.iterdir()}
    # stopped after the move, or its outputs removed: it runs again alone, from the parts in place
    (tmp_path / "c.json").unlink()
    assert write_deduplicated(cfg, ds, p, 2, tmp_path / "c.json", tmp_path / "r.jsonl")["rows_out"] == 4
    # one job run again (its report removed): its parts are new, the others' are taken from deduplicated/
    write_kept(cfg, ds, p, 2, 1)
    assert write_deduplicated(cfg, ds, p, 2, tmp_path / "c.json", tmp_path / "r.jsonl")["rows_out"] == 4
    assert {x.name: x.read_bytes() for x in out.iterdir()} == before


def test_the_write_stages_fail_loudly_when_the_records_do_not_add_up(tmp_path):
    import numpy as np

    from mirageflow.data.dedup_stages import write_deduplicated, write_kept
    from mirageflow.state.layout import StateLayout

    cfg, ds, p = staged(tmp_path)
    paths = StateLayout(cfg.state_dir)
    decisions = np.load(paths.dedup_decisions(0))
    wrong = decisions.copy()
    wrong["row"][-1] = (3 << 32) | 5  # a record part 3 does not have
    np.save(paths.dedup_decisions(0), wrong)
    with pytest.raises(DedupError, match=r"decisions.npy: names record 5 of .*part-00003.jsonl, which holds 2"):
        write_kept(cfg, ds, p, 2, 1)
    np.save(paths.dedup_decisions(0), decisions)
    for job in (0, 1):
        write_kept(cfg, ds, p, 2, job)
    report = json.loads(paths.dedup_written(0, 1).read_text())
    report["parts"][0]["rows_out"] += 1  # a record written twice: 2 written + 1 removed from 2
    paths.dedup_written(0, 1).write_text(json.dumps(report))
    with pytest.raises(DedupError, match=r"written_1.json: part part-00001.jsonl read 2 records, wrote 2 and removed 1"):
        write_deduplicated(cfg, ds, p, 2, tmp_path / "c.json", tmp_path / "r.jsonl")
    write_kept(cfg, ds, p, 2, 1)
    (Path(ds.output_dir) / ".deduplicated.parts/part-00002.jsonl").write_bytes(b"changed after its job\n")
    with pytest.raises(DedupError, match=r"part-00002.jsonl: missing, or not the part .*written_0.json says it wrote"):
        write_deduplicated(cfg, ds, p, 2, tmp_path / "c.json", tmp_path / "r.jsonl")
    assert not (Path(ds.output_dir) / "deduplicated").exists() and not (tmp_path / "c.json").exists()
    np.save(paths.dedup_decisions(0), decisions[:-1])  # decided again: the jobs' reports are stale
    with pytest.raises(DedupError, match=r"written_0.json: not this dedup's stage 4 report .*remove it and rerun"):
        write_deduplicated(cfg, ds, p, 2, tmp_path / "c.json", tmp_path / "r.jsonl")


@pytest.mark.parametrize("k, num_perm", [(1, 32), (3, 128), (5, 128), (5, 7)])
def test_the_signatures_are_datasketchs_minhash(k, num_perm):
    """Signer (numpy, CRC-32 by tables for ASCII) gives the values datasketch's MinHash gives."""
    import zlib

    from datasketch import MinHash

    from mirageflow.data.dedup_stages import Signer

    signer, base = Signer(params(num_perm=num_perm, shingle_size=k)), MinHash(num_perm=num_perm, seed=1)
    texts = ["", "a", "abcd", BASE, NEAR, "café été naïve résumé " * 5, "🙂 emoji 🙂 and text", "x" * 9000, OTHER * 80]
    for text in map(normalize, texts):
        m = MinHash(num_perm=num_perm, seed=1, permutations=base.permutations, scheme=base.scheme, hashfunc=zlib.crc32)
        m.update_batch(list(shingles(text, k)))
        assert m.hashvalues.tolist() == signer.signature(text).tolist(), text[:30]


def test_the_lsh_banding_is_datasketchs_without_datasketch():
    """data/minhash.py's banding (numpy) is what datasketch's MinHashLSH picks, refusals included."""
    from datasketch import MinHashLSH

    from mirageflow.data.dedup import LSH_WEIGHTS
    from mirageflow.data.minhash import lsh_bands

    for num_perm in (2, 3, 7, 32, 128):
        for threshold in [i / 20 for i in range(1, 20)] + [0.97, 0.99, 0.995]:
            try:
                lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
                expected = (lsh.b, lsh.r)
            except ValueError:
                expected = "refused"
            try:
                found = lsh_bands(threshold, num_perm, LSH_WEIGHTS)
            except ValueError:
                found = "refused"
            assert found == expected, (num_perm, threshold)


def test_a_signatures_job_imports_neither_datasketch_nor_scipy(tmp_path):
    """datasketch imports scipy (~1-2 CPU-s a process) for arrays numpy computes (data/minhash.py)."""
    cfg, ds = dataset(tmp_path, "jsonl")
    lines = [json.dumps({"text": t, "source_index": i}).encode() + b"\n" for i, t in enumerate([BASE, NEAR, OTHER])]
    write_merged([lines], Path(ds.output_dir) / "merged", "jsonl")
    script = f"""
import sys
from pathlib import Path
from mirageflow.config.types import DedupParams
from mirageflow.data.dedup_stages import write_signatures
from mirageflow.state.layout import StateLayout
params = DedupParams(**{dict(vars(params()))!r})
files = StateLayout({cfg.state_dir!r}).dedup_signatures(0, 0)
files["meta"].parent.mkdir(parents=True)
meta = write_signatures(Path({ds.output_dir!r}) / "merged", "jsonl", params, 1, 0, files)
print(meta["bands"], sorted(m for m in sys.modules if m.split(".")[0] in ("datasketch", "scipy")))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["11", "[]"]  # 11 bands of 11 at 0.85 and 128 permutations, nothing imported


def test_one_dedup_job_per_eight_shards_at_least_one_at_most_the_cap():
    from mirageflow.data.dedup import MAX_PARTITIONS, dedup_partitions

    assert [dedup_partitions(SimpleNamespace(num_shards=n)) for n in (1, 8, 9, 200, 10**6)] == [1, 1, 2, 25, MAX_PARTITIONS]


def test_a_chain_of_near_duplicates_keeps_what_no_kept_record_covers():
    a = " ".join(f"w{i}" for i in range(40))
    b = " ".join(f"w{i}" for i in range(3, 43))  # ~0.86 to a
    c = " ".join(f"w{i}" for i in range(6, 46))  # ~0.86 to b, ~0.73 to a
    out = run([a, b, c], threshold=0.8)
    assert out[0] is None and out[1][:2] == ("near", 0) and out[2] is None


def test_all_duplicates_cost_one_edge_per_record_not_per_pair(tmp_path):
    """Equal signatures are one class: each copy gets one edge to the first, none between copies."""
    from mirageflow.data import dedup_stages as stages
    from mirageflow.state.layout import StateLayout

    cfg, ds = dataset(tmp_path, "jsonl")
    lines = [json.dumps({"text": BASE, "source_index": i}).encode() + b"\n" for i in range(200)]
    write_merged([lines[:100], lines[100:]], Path(ds.output_dir) / "merged", "jsonl")
    write_manifest(cfg, 200)
    counts = dedup_dataset(cfg, ds, params(exact=False), tmp_path / "c.json", tmp_path / "r.jsonl", partitions=3)
    assert (counts["near_duplicates_removed"], counts["rows_out"]) == (199, 1)
    edges = stages.load_edges([StateLayout(cfg.state_dir).dedup_edges(0, k) for k in range(3)])
    assert len(edges) == 199 and set(edges["kind"].tolist()) == {stages.EDGE_CLASS}


def test_a_pairs_job_reads_only_its_partition_of_each_signature_file(tmp_path):
    """Stage 2's memory is its share: entries of the other partitions, replaced by entries that
    would make many edges, change nothing in its output."""
    import numpy as np

    from mirageflow.data import dedup_stages as stages
    from mirageflow.state.layout import StateLayout

    cfg, ds = dataset(tmp_path, "jsonl")
    parts = hostile_records(seed=0)
    items = [[json.dumps(r).encode() + b"\n" for r in part] for part in parts]
    write_merged(items, Path(ds.output_dir) / "merged", "jsonl")
    write_manifest(cfg, sum(map(len, parts)))
    n, p = 3, params()
    paths = StateLayout(cfg.state_dir)
    files = [paths.dedup_signatures(0, k) for k in range(n)]
    for job in range(n):
        stages.write_signatures(Path(ds.output_dir) / "merged", "jsonl", p, n, job, files[job])
    for partition in range(n):
        stages.write_pairs(p, n, partition, files, tmp_path / f"before_{partition}.npy")
    before = [np.load(tmp_path / f"before_{k}.npy") for k in range(n)]
    assert all(len(e) for e in before)
    target = 1
    for job, f in enumerate(files):
        meta = json.loads(f["meta"].read_text())
        for kind, offsets in (("classes", meta["class_offsets"]), ("bands", meta["band_offsets"])):
            entries = np.load(f[kind])
            lo, hi = offsets[target], offsets[target + 1]
            outside = np.ones(len(entries), dtype=bool)
            outside[lo:hi] = False
            # every entry elsewhere now claims one class and one bucket: one edge per entry if read
            for name in entries.dtype.names:
                if name != "row":
                    entries[name][outside] = entries[name][0] if len(entries) else 0
            np.save(f[kind], entries)
    stages.write_pairs(p, n, target, files, tmp_path / "after.npy")
    assert np.load(tmp_path / "after.npy").tobytes() == before[target].tobytes()


# --------------------------------------------------------------------------- config


def pipeline_dict(dedup: dict, merge: bool = True, remove_columns: bool = True) -> dict:
    return pipeline_config(
        model="m", state_dir=None, num_shards=None, dataset={"type": "jsonl"}, outputs=[{"name": "answer", "prompt": "{{ q }}"}],
        processor={"backend": "openai", "base_url": "http://h:1/v1"},
        processing={"remove_columns": remove_columns, "output_schema": {"question": "{{ q }}", "answer": "{{ answer }}"}},
        execution_params={"merge": merge}, deduplication_params=dedup,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dedup, kw, expected",
    [
        ({"enabled": True, "text_field": "answer"}, {"merge": False}, "deduplication_params.enabled: needs execution_params.merge: true"),
        ({"enabled": True}, {}, "deduplication_params.text_field: required when enabled"),
        ({"enabled": True, "text_field": "anwser"}, {}, "deduplication_params.text_field: 'anwser' is not a field of the records (remove_columns is true; fields: question, answer) (did you mean 'answer'?)"),
        ({"enabled": True, "text_field": "answer", "threshold": 0}, {}, "deduplication_params.threshold: 0 is less than or equal to the minimum of 0"),
        ({"enabled": True, "text_field": "answer", "threshold": 1.01}, {}, "deduplication_params.threshold: 1.01 is greater than the maximum of 1"),
        ({"enabled": True, "text_field": "answer", "num_perm": 1}, {}, "deduplication_params.num_perm: 1 is less than the minimum of 2"),
        ({"enabled": True, "text_field": "answer", "shingle_size": 0}, {}, "deduplication_params.shingle_size: 0 is less than the minimum of 1"),
        ({"enabled": True, "text_field": "answer", "exact": False, "fuzzy": False}, {}, "deduplication_params: exact and fuzzy are both false"),
        ({"enabled": True, "text_field": "answer", "treshold": 0.9}, {}, "deduplication_params.treshold: unknown key (did you mean 'threshold'?)"),
    ],
)  # fmt: skip
def test_config_mistakes_are_caught_at_load_with_the_key(dedup, kw, expected):
    with pytest.raises(ConfigError) as e:
        load_config(pipeline_dict(dedup, **kw), check_paths=False)
    assert any(expected in p for p in e.value.problems), e.value.problems


def test_valid_configs():
    assert load_config(pipeline_dict({}), check_paths=False).dedup is None  # off by default
    cfg = load_config(pipeline_dict({"enabled": True, "text_field": "answer", "threshold": 1}), check_paths=False)
    assert cfg.dedup == params(text_field="answer", threshold=1)
    # remove_columns false: a source column may be meant
    assert load_config(pipeline_dict({"enabled": True, "text_field": "body"}, remove_columns=False), check_paths=False).dedup


def test_changed_parameters_remove_the_old_outputs(tmp_path):
    cfg = load_config(
        pipeline_dict({"enabled": True, "text_field": "answer"})
        | {
            "loading_params": {
                "state_dir": str(tmp_path / "s"),
                "datasets": [{"path": "in.jsonl", "type": "jsonl", "output_dir": str(tmp_path / "o")}],
            }
        },
        check_paths=False,
    )
    counts = tmp_path / "s/dedup/dataset_0.json"
    counts.parent.mkdir(parents=True)
    (tmp_path / "o/deduplicated").mkdir(parents=True)
    same = {k: getattr(cfg.dedup, k) for k in ("text_field", "exact", "fuzzy", "threshold", "num_perm", "shingle_size")}
    counts.write_text(json.dumps(same))
    assert remove_stale_dedup_outputs(cfg) == [] and counts.exists()
    (tmp_path / "s/dedup/dataset_0").mkdir()  # the stages' files (data/dedup_stages.py)
    (tmp_path / "o/.deduplicated.parts").mkdir()  # parts the dedup_write jobs wrote with the old parameters
    counts.write_text(json.dumps({**same, "threshold": 0.5}))
    assert remove_stale_dedup_outputs(cfg) and not counts.exists() and not (tmp_path / "o/deduplicated").exists()
    assert not (tmp_path / "s/dedup/dataset_0").exists() and not (tmp_path / "o/.deduplicated.parts").exists()


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def test_workflow_deduplicates_after_merge_and_reports_the_counts(tmp_path, server):
    texts = [BASE, OTHER, BASE.upper(), NEAR, "A third text, different from the others in every way.", OTHER + "  ", BASE]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    cfg = {
        "processors": [{"type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "fake-model"},
                        "default_sampling_params": {"max_new_tokens": 3}, "max_retries": 0}],
        "loading_params": {"state_dir": "state", "num_shards": 2,
                           "datasets": [{"path": "in.jsonl", "type": "jsonl", "output_dir": "out", "output_format": "parquet"}]},
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}, {"name": "id", "key": "id"}],
            "outputs": [{"name": "answer", "prompt": "Summarise: {{ text }}"}],
            "remove_columns": True,
            "output_schema": {"id": "{{ id }}", "text": "{{ text }}", "answer": "{{ answer }}"},
        },
        "deduplication_params": {"enabled": True, "text_field": "text"},
    }  # fmt: skip
    proc = run_workflow(tmp_path, cfg)
    # two shards: each stage is one job (one per 8 shards: dedup_partitions; several: the tests above)
    assert proc.text.count("rule dedup_signatures:") == 1 and proc.text.count("rule dedup_pairs:") == 1
    assert proc.text.count("rule dedup_decide:") == 1 and proc.text.count("rule dedup_write:") == 1
    assert not (tmp_path / "out/.deduplicated.parts").exists()  # the dedup rule moved the parts into deduplicated/
    kept = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out/deduplicated").glob("*.parquet"))])
    assert kept.column("id").to_pylist() == [0, 1, 4]
    merged = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out/merged").glob("*.parquet"))])
    assert merged.num_rows == 7 and kept.schema.equals(merged.schema, check_metadata=True)
    counts = json.loads((tmp_path / "state/dedup/dataset_0.json").read_text())
    assert (counts["rows_in"], counts["exact_duplicates_removed"], counts["near_duplicates_removed"], counts["rows_out"]) == (7, 3, 1, 3)
    removed = [json.loads(x) for x in (tmp_path / "state/dedup/dataset_0.removed.jsonl").read_text().splitlines()]
    assert [(r["row"], r["source_index"], r["kind"], r["duplicate_of"]) for r in removed] == [
        (2, 2, "exact", 0), (3, 3, "near", 0), (5, 5, "exact", 1), (6, 6, "exact", 0),
    ]  # fmt: skip
    metrics = json.loads((tmp_path / "state/metrics.json").read_text())
    assert metrics["deduplication"][0]["rows_out"] == 3
    assert "## Deduplication (after merge)" in (tmp_path / "state/summary.md").read_text()
    assert "<h2>Deduplication (after merge)</h2>" in (tmp_path / "state/report.html").read_text()

    # a parameter change reruns the dedup rule only (not the shards), whatever the rerun triggers
    cfg["deduplication_params"]["fuzzy"] = False
    proc = run_workflow(tmp_path, cfg, "--rerun-triggers", "mtime")
    assert shard_jobs(proc) == 0 and "rule dedup:" in proc.text
    assert proc.text.count("rule dedup_signatures:") == 1 and proc.text.count("rule dedup_pairs:") == 1  # stale stages too
    assert proc.text.count("rule dedup_decide:") == 1 and proc.text.count("rule dedup_write:") == 1
    counts = json.loads((tmp_path / "state/dedup/dataset_0.json").read_text())
    assert (counts["near_duplicates_removed"], counts["rows_out"]) == (0, 4)
    assert json.loads((tmp_path / "state/metrics.json").read_text())["deduplication"][0]["rows_out"] == 4

    # `mmirage merge` deduplicates too when enabled (and still never starts a shard)
    for path in (tmp_path / "state/dedup").glob("dataset_0*.*"):
        path.unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", "merge", "--config", "pipeline.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--allowed-rules merge dedup" in proc.stderr and "rule shard:" not in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "state/dedup/dataset_0.json").read_text())["rows_out"] == 4


def test_a_threshold_datasketch_cannot_band_is_refused_by_the_driver():
    from mirageflow.data.dedup import dedup_problems

    cfg = load_config(pipeline_dict({"enabled": True, "text_field": "answer", "threshold": 0.995}), check_paths=False)
    [problem] = dedup_problems(cfg)
    assert problem.startswith("deduplication_params.threshold: 0.995 with num_perm 128 cannot be indexed") and "raise num_perm" in problem
    for ok in ({"threshold": 0.995, "fuzzy": False}, {"threshold": 1}, {"threshold": 0.99}):
        assert dedup_problems(load_config(pipeline_dict({"enabled": True, "text_field": "answer", **ok}), check_paths=False)) == []


def test_a_text_field_that_is_no_column_of_the_data_is_refused_by_the_driver(tmp_path):
    from mirageflow.config.preflight import preflight_problems

    (tmp_path / "in.jsonl").write_text(json.dumps({"q": "x", "body": "text"}) + "\n")
    raw = pipeline_dict({"enabled": True, "text_field": "bdy"}, remove_columns=False)
    raw["loading_params"]["datasets"][0].update(path=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"))
    problems = [p for p in preflight_problems(load_config(raw)) if p.startswith("deduplication_params")]
    assert problems == [
        "deduplication_params.text_field: 'bdy' is neither a field the config produces (question, answer) nor a column "
        f"of the first 1 rows of loading_params.datasets[0] ('{tmp_path / 'in.jsonl'}'; columns: body, q)"
    ]
    raw["deduplication_params"]["text_field"] = "body"
    assert [p for p in preflight_problems(load_config(raw)) if p.startswith("deduplication_params")] == []
