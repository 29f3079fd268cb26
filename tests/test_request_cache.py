"""The request cache: an edit sends only the requests whose key is new; the cache is verified
like the parts, keyed by exactly what determines an answer, and never hides a draw or an error.

The engine is the `openai` backend against the fake OpenAI-compatible server
(tests/fakes/fake_http.py, a thread of this process), which records every request it gets.
Shards run in this process with `run_shard` (no Snakemake: the workflow-level cases are in
scripts/bench/request_cache.py and tests/test_reruns.py).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer

from mirageflow.config import load_config
from mirageflow.data.writers import read_parts
from mirageflow.shard import ShardFailed, index_datasets, run_shard
from mirageflow.shard import request_cache as rc
from mirageflow.engines.wire import Completion, Request

pytestmark = pytest.mark.usefixtures("no_proxy")

ROWS = 6


@pytest.fixture
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def pipeline(root: Path, server: FakeServer, rows: list[dict] | None = None, num_shards: int = 1) -> dict:
    data = root / "in.jsonl"
    if rows is not None or not data.exists():
        write_rows(data, rows or [{"text": f"passage {i}"} for i in range(ROWS)])
    return pipeline_config(
        data, inputs=["text"], model="fake-model", state_dir=root / "state", output_dir=root / "out", num_shards=num_shards,
        outputs=[
            {"name": "summary", "prompt": "Summarise: {{ text }}"},
            {"name": "title", "prompt": "Title for {{ text }}: {{ summary }}"},  # every request distinct
        ],
        dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": server.url + "/v1", "default_sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
                   "max_retries": 0, "request_timeout": 30},
        processing={"output_schema": {"summary": "{{ summary }}", "title": "{{ title }}"}},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
    )  # fmt: skip


def run(raw: dict, shard: int = 0, reindex: bool = True) -> dict:
    cfg = load_config(copy.deepcopy(raw))
    if reindex:
        index_datasets(cfg)
    return run_shard(cfg, shard)


def prompts_since(server: FakeServer, start: int) -> list[str]:
    return [r["body"]["messages"][-1]["content"] for r in server.records[start:]]


def records(root: Path, shard: int = 0) -> list[dict]:
    return sorted(read_parts(root / "out" / f"shard_{shard}", "jsonl").to_pylist(), key=lambda r: r["source_index"])


# --------------------------------------------------------------------------- what an edit sends


def test_editing_the_record_template_sends_no_request(tmp_path, server):
    raw = pipeline(tmp_path, server)
    first = run(raw)
    assert len(server.records) == 2 * ROWS and first["stats"]["requests_cached"] == 0
    assert first["stats"]["request_cache"]["answers_kept"] == 2 * ROWS

    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"t": "{{ title }}", "both": "{{ summary }} / {{ title }}"}
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) == sent  # not one request
    assert status["stats"]["requests"] == 0 and status["stats"]["requests_cached"] == 2 * ROWS
    out = records(tmp_path)
    assert [r["source_index"] for r in out] == list(range(ROWS)) and all(set(r) >= {"t", "both"} for r in out)
    assert out[0]["both"].startswith(out[0]["both"].split(" / ")[0])


def test_editing_the_second_prompt_resends_only_its_requests(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["outputs"][1]["prompt"] = "A short title for {{ text }}: {{ summary }}"
    sent = len(server.records)
    status = run(edited)
    again = prompts_since(server, sent)
    assert len(again) == ROWS and all(p.startswith("A short title for ") for p in again)
    assert status["stats"]["requests"] == ROWS and status["stats"]["requests_cached"] == ROWS


def test_editing_one_row_resends_that_rows_requests(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    before = records(tmp_path)
    rows = [{"text": f"passage {i}"} for i in range(ROWS)]
    rows[3] = {"text": "an edited passage"}
    edited = pipeline(tmp_path, server, rows=rows)  # the same config, the dataset rewritten
    sent = len(server.records)
    run(edited)
    again = prompts_since(server, sent)
    assert again[0] == "Summarise: an edited passage" and again[1].startswith("Title for an edited passage: ") and len(again) == 2
    after = records(tmp_path)
    assert [r for i, r in enumerate(after) if i != 3] == [r for i, r in enumerate(before) if i != 3]


def test_cached_answers_give_the_records_a_fresh_run_gives(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}", "t": "{{ title }}"}
    run(edited)
    cached = records(tmp_path)
    fresh_root = tmp_path / "fresh"
    fresh_root.mkdir()
    fresh = pipeline(fresh_root, server)
    fresh["processing_params"]["output_schema"] = edited["processing_params"]["output_schema"]
    fresh["shard_params"]["request_cache"] = False
    run(fresh)
    assert records(fresh_root) == cached
    assert not (fresh_root / "state" / "shard_0" / "request_cache").exists()


# --------------------------------------------------------------------------- never a draw, never an error


def test_sampling_without_a_seed_is_never_reused(tmp_path, server):
    raw = pipeline(tmp_path, server)
    raw["processors"][0]["default_sampling_params"] = {"max_new_tokens": 5, "temperature": 0.7}
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) - sent == 2 * ROWS and status["stats"]["requests_cached"] == 0
    assert status["stats"]["request_cache"]["answers_kept"] == 0

    # with a seed the draw is reproducible: kept and reused
    seeded = copy.deepcopy(raw)
    seeded["processors"][0]["default_sampling_params"]["seed"] = 7
    run(seeded)
    seeded["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    assert run(seeded)["stats"]["requests_cached"] == 2 * ROWS and len(server.records) == sent


def test_row_errors_are_not_kept_so_a_rerun_asks_again(tmp_path, server):
    rows = [{"text": "TOO_LONG" if i == 1 else f"passage {i}"} for i in range(ROWS)]
    raw = pipeline(tmp_path, server, rows=rows)
    first = run(raw)
    assert first["stats"]["rows_failed_by_class"] == {"context_length": 1}
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    status = run(edited)
    assert prompts_since(server, sent) == ["Summarise: TOO_LONG"]  # only the failed row's request, again
    assert status["stats"]["rows_failed_by_class"] == {"context_length": 1}


def test_an_answer_the_step_rejects_is_not_kept(tmp_path, server):
    raw = pipeline(tmp_path, server)
    raw["processing_params"]["outputs"][1] = {"name": "title", "prompt": "Title for {{ text }}: {{ summary }}", "output_type": "JSON",
                                              "output_schema": {"answer": "int"}}  # fmt: skip
    with pytest.raises(ShardFailed, match=r"json_schema: 6"):  # the fake answers {"answer": "yes"}: every row fails
        run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    with pytest.raises(ShardFailed, match=r"json_schema: 6"):
        run(edited)
    again = prompts_since(server, sent)
    assert len(again) == ROWS and all(p.startswith("Title for ") for p in again)  # the summaries were kept


def test_fresh_answers_asks_the_engine_again_and_replaces_the_kept_answers(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    edited["fresh_answers"] = True
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) - sent == 2 * ROWS and status["stats"]["requests_cached"] == 0
    edited["fresh_answers"] = False
    edited["processing_params"]["output_schema"] = {"s2": "{{ summary }}"}
    sent = len(server.records)
    assert run(edited)["stats"]["requests_cached"] == 2 * ROWS and len(server.records) == sent


def test_another_model_never_gets_the_cached_answers(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    for edit in (
        lambda p: p["server_args"].update(model_path="other-model"),
        lambda p: p.update(chat_template_kwargs={"enable_thinking": False}),
        lambda p: p["default_sampling_params"].update(max_new_tokens=6),
    ):
        edited = copy.deepcopy(raw)
        edit(edited["processors"][0])
        sent = len(server.records)
        status = run(edited)
        assert len(server.records) - sent == 2 * ROWS and status["stats"]["requests_cached"] == 0, edited["processors"][0]


def test_a_local_models_revision_is_part_of_the_key(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"n_layer": 2}')
    (model / "model.safetensors").write_bytes(b"a" * 5000)
    one = rc.model_revision(str(model))
    (model / "model.safetensors").write_bytes(b"a" * 2500 + b"b" + b"a" * 2499)  # same size, other weights
    two = rc.model_revision(str(model))
    (model / "config.json").write_text('{"n_layer": 3}')
    assert len({one, two, rc.model_revision(str(model))}) == 3
    assert rc.model_revision("a-server-side-name") is None
    ident = {"backend": "transformers", "server_args": {"model_path": str(model)}}
    req = Request(0, None, "hi", {"temperature": 0.0}, None)
    assert rc.request_key(rc.engine_identity(ident, "transformers", one), req) != rc.request_key(
        rc.engine_identity(ident, "transformers", two), req
    )
    # the row's id is not part of the key; the seed, the schema and the prefix are
    key = rc.request_key("e", req)
    assert rc.request_key("e", Request(9, None, "hi", {"temperature": 0.0}, None)) == key
    assert len({key, rc.request_key("e", Request(0, None, "hi", {"temperature": 0.0}, None, seed=1)),
                rc.request_key("e", Request(0, None, "hi", {"temperature": 0.0}, '{"type": "object"}')),
                rc.request_key("e", Request(0, None, "hi", {"temperature": 0.0}, None, response_prefix="{"))}) == 4  # fmt: skip


# --------------------------------------------------------------------------- hostile state


def _cache_dir(root: Path, shard: int = 0) -> Path:
    return root / "state" / f"shard_{shard}" / rc.CACHE_DIR


def test_a_damaged_segment_is_moved_aside_and_its_answers_asked_again(tmp_path, server, caplog):
    raw = pipeline(tmp_path, server)
    run(raw)
    manifest = json.loads((_cache_dir(tmp_path) / rc.MANIFEST).read_text())
    assert sum(s["entries"] for s in manifest["segments"]) == 2 * ROWS  # one segment per commit
    victim = _cache_dir(tmp_path) / manifest["segments"][0]["name"]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x20  # same size, other bytes
    victim.write_bytes(bytes(data))
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}", "t": "{{ title }}"}
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) - sent == manifest["segments"][0]["entries"]
    assert status["stats"]["requests_cached"] == 2 * ROWS - manifest["segments"][0]["entries"]
    assert list((_cache_dir(tmp_path) / "damaged").glob(f"*/{victim.name}"))
    assert "request cache segment" in caplog.text and "moved to" in caplog.text


@pytest.mark.parametrize("damage", [b"not json", b'{"format": 1, "segments": [{"name": "../x"}]}', b'{"format": 99, "segments": []}'])
def test_a_damaged_manifest_is_kept_aside_and_the_cache_starts_empty(tmp_path, server, caplog, damage):
    raw = pipeline(tmp_path, server)
    run(raw)
    (_cache_dir(tmp_path) / rc.MANIFEST).write_bytes(damage)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    run(edited)
    assert len(server.records) - sent == 2 * ROWS
    assert list(_cache_dir(tmp_path).glob("manifest.json.damaged-*"))
    assert list((_cache_dir(tmp_path) / "orphaned").glob("*/seg-*.jsonl"))  # the old segments, kept
    # the new cache is whole: the next edit sends nothing
    edited["processing_params"]["output_schema"] = {"s2": "{{ summary }}"}
    sent = len(server.records)
    run(edited)
    assert len(server.records) == sent


def test_a_segment_written_by_a_killed_commit_is_set_aside(tmp_path, server):
    """A kill after a segment's rename but before the manifest's: the segment is unlisted;
    a kill before the rename leaves a temp file. Neither is trusted, neither breaks the cache."""
    raw = pipeline(tmp_path, server)
    run(raw)
    d = _cache_dir(tmp_path)
    (d / "seg-00099.jsonl").write_text(json.dumps(["0" * 64, "forged", None, 1, 1, "stop", None]) + "\n")
    (d / ".seg-00100.jsonl.abc.tmp").write_text("half")
    cache = rc.RequestCache(d.parent)
    cache.restore()
    assert len(cache) == 2 * ROWS and cache.get("0" * 64, 0) is None
    assert not list(d.glob(".*.tmp")) and list((d / "orphaned").glob("*/seg-00099.jsonl"))


def test_a_commit_that_fails_keeps_its_answers_for_the_next(tmp_path, monkeypatch):
    cache = rc.RequestCache(tmp_path)
    cache.restore()
    cache.put("a" * 64, Completion(0, "yes", 3, 1, "stop"))
    real = os.replace
    monkeypatch.setattr(rc.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        cache.commit()
    monkeypatch.setattr(rc.os, "replace", real)
    cache.commit()
    again = rc.RequestCache(tmp_path)
    again.restore()
    assert again.get("a" * 64, 5) == Completion(5, "yes", 3, 1, "stop")


def test_answers_holding_unicode_line_breaks_are_read_back(tmp_path):
    """JSON leaves U+2028, U+2029 and U+0085 unescaped: a segment's lines are split at its newlines only."""
    cache = rc.RequestCache(tmp_path)
    cache.restore()
    answers = {"a" * 64: Completion(0, "one\u2028two\u2029three\x85four", 3, 1, "stop"), "b" * 64: Completion(1, "plain", 2, 1, "stop")}
    for key, c in answers.items():
        cache.put(key, c)
    cache.commit()
    again = rc.RequestCache(tmp_path)
    again.restore()
    assert [again.get(key, c.id) for key, c in answers.items()] == list(answers.values())
    assert not (again.dir / "damaged").exists()


SHARD_JOB = """
import sys
from mirageflow.config import load_config
from mirageflow.shard import run_shard
import yaml
run_shard(load_config(sys.argv[1]), int(sys.argv[2]))
"""


def _run_job(root: Path, raw: dict, shard: int) -> subprocess.Popen:
    import yaml

    path = root / f"pipeline_{shard}.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.Popen([sys.executable, "-c", SHARD_JOB, str(path), str(shard)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_concurrent_shards_keep_their_own_caches(tmp_path):
    server = FakeServer(Behaviour(latency=0.05)).start()
    try:
        raw = pipeline(tmp_path, server, rows=[{"text": f"passage {i}"} for i in range(12)], num_shards=2)
        index_datasets(load_config(copy.deepcopy(raw)))
        jobs = [_run_job(tmp_path, raw, k) for k in (0, 1)]
        outs = [j.communicate(timeout=120)[0] for j in jobs]
        assert all(j.returncode == 0 for j in jobs), outs
        assert server.peak_in_flight > 1
        for k in (0, 1):
            cache = rc.RequestCache(_cache_dir(tmp_path, k).parent)
            cache.restore()
            assert len(cache) == 12  # its own 6 rows x 2 outputs
        edited = copy.deepcopy(raw)
        edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
        sent = len(server.records)
        jobs = [_run_job(tmp_path, edited, k) for k in (0, 1)]
        assert all(j.wait(timeout=120) == 0 for j in jobs)
        assert len(server.records) == sent
    finally:
        server.stop()


def test_a_shard_killed_mid_commit_resumes_with_a_whole_cache(tmp_path):
    """SIGKILL while the shard commits rows and answers (checkpoint_rows 1): the rerun finds
    no damaged segment, and every answer kept is one that no request has to repeat."""
    server = FakeServer(Behaviour(latency=0.02)).start()
    try:
        raw = pipeline(tmp_path, server, rows=[{"text": f"passage {i}"} for i in range(40)])
        raw["shard_params"].update(checkpoint_rows=1, max_inflight=4)
        index_datasets(load_config(copy.deepcopy(raw)))
        job = _run_job(tmp_path, raw, 0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(server.records) < 30:
            time.sleep(0.01)
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=30)
        killed_at = len(server.records)
        kept = rc.RequestCache(_cache_dir(tmp_path).parent)
        kept.restore()
        assert not (_cache_dir(tmp_path) / "damaged").exists()
        edited = copy.deepcopy(raw)
        edited["processing_params"]["output_schema"] = {"s": "{{ summary }}", "t": "{{ title }}"}
        status = run(edited, reindex=False)
        assert status["stats"]["rows_processed"] == 40
        # every request after the kill was one the cache did not hold
        assert len(server.records) - killed_at == 80 - len(kept)
        assert status["stats"]["requests_cached"] == len(kept) > 0
    finally:
        server.stop()
