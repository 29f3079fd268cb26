"""Hostile rows through the whole workflow (real `snakemake`, the openai backend against the
fake server): a green run is proof. Every input row ends as a merged record or a recorded
row error, every field of every record comes back with its value, and odd rows stay row
errors with their class and source index."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_workflow
from fakes.configs import pipeline_config
from fakes.fake_http import FakeServer

from mirageflow.data.writers import is_json_field

pytestmark = pytest.mark.usefixtures("no_proxy")

BIG = 2**63 + 5  # above int64


def hostile_lines() -> tuple[list[str], dict[int, str]]:
    """JSONL lines, and the error class expected for each bad row (by source index)."""
    rows = [
        {"id": 1, "title": "plain", "lang": "en", "meta": {"a": 1}},
        {"id": "two", "title": "id is a string here", "meta": {"b": [1, 2]}},  # no lang, other meta keys
        {"id": BIG, "title": "an id above int64", "lang": "fr", "": "empty key", "a.b": "dotted", " ": "space"},
        {"id": 4, "title": 12345, "lang": None},  # a number where others have a string
        {"id": 5, "title": ["a", "list"], "lang": True},
        {"id": 6, "title": {"a": "dict"}, "lang": 3.5, "meta": "now a string"},
    ]
    lines = [json.dumps(r) for r in rows]
    expected = {}
    lines.append("[" * 100_000 + "]" * 100_000)  # too deep for Python's json: bad_row
    expected[len(lines) - 1] = "bad_row"
    lines.append('{"id": 8, "title": "lone \\ud800 surrogate"}')
    expected[len(lines) - 1] = "invalid_unicode"
    lines.append('{"id": 9, "title": "fine again", "lang": "de"}')
    lines.append("{not json")
    expected[len(lines) - 1] = "bad_row"
    lines.append('{"id": 11, "title": "TOO_LONG prompt"}')  # the server's context-length error
    expected[len(lines) - 1] = "context_length"
    return lines, expected


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def pipeline(server, fmt: str) -> dict:
    return pipeline_config(
        inputs=["title"], outputs=[{"name": "answer", "prompt": "Say something about {{ title }}"}], model="fake-model",
        num_shards=3, dataset={"type": "jsonl", "output_format": fmt}, processing={"remove_columns": False},
        processor={"backend": "openai", "base_url": server.url + "/v1", "default_sampling_params": {"max_new_tokens": 3},
                   "max_retries": 0, "request_timeout": 30},
        shard_params={"max_error_rate": 0.7},
    )  # fmt: skip


def merged_records(out: Path, fmt: str) -> list[dict]:
    files = sorted((out / "merged").glob(f"part-*.{fmt}"))
    if fmt == "jsonl":
        return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines()]
    records = []
    for f in files:
        table = pq.read_table(f)
        json_cols = {field.name for field in table.schema if is_json_field(field)}
        for r in table.to_pylist():
            records.append({k: (json.loads(v) if k in json_cols and v is not None else v) for k, v in r.items()})
    return records


def same(got, want, fmt: str) -> bool:
    """Equal, types included. Parquet stores objects as structs of the union of their keys,
    so a key an object lacks reads back as null (the documented storage rule)."""
    if isinstance(want, dict) and isinstance(got, dict):
        extra = set(got) - set(want)
        return (
            set(want) <= set(got)
            and all(same(got[k], want[k], fmt) for k in want)
            and (fmt == "parquet" and all(got[k] is None for k in extra) or not extra)
        )
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(same(g, w, fmt) for g, w in zip(got, want))
    return got == want and type(got) is type(want)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_hostile_rows_every_row_accounted_for_and_every_field_kept(tmp_path, server, fmt):
    lines, expected_errors = hostile_lines()
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run_workflow(tmp_path, pipeline(server, fmt))

    errors = {}
    for shard in range(3):
        for line in (tmp_path / f"state/shard_{shard}/errors.jsonl").read_text(encoding="utf-8").splitlines():
            e = json.loads(line)
            assert e["source_index"] not in errors, "a row recorded twice"
            errors[e["source_index"]] = e["error"]
    assert errors == expected_errors

    records = merged_records(tmp_path / "out", fmt)
    assert [r["source_index"] for r in records] == [i for i in range(len(lines)) if i not in expected_errors]
    for r in records:
        source = json.loads(lines[r["source_index"]])
        for key, value in source.items():  # every input field, with its value and type
            assert same(r[key], value, fmt), (r["source_index"], key, r[key], value)
        assert r["answer"]  # a real, non-empty answer
    # a field absent from a row is null there (Parquet) or absent (JSONL), never dropped elsewhere
    assert sum(1 for r in records if r.get("lang") is not None) == sum(
        1 for i, line in enumerate(lines) if i not in expected_errors and json.loads(line).get("lang") is not None
    )

    metrics = json.loads((tmp_path / "state/metrics.json").read_text())["aggregate"]
    assert metrics["total_rows_processed"] == len(records)
    assert metrics["total_rows_failed"] == len(expected_errors)
