"""Several samples per row (processing_params.n_samples, preserve_columns): order, sample
indices, per-sample seeds, per-sample errors, exact resume after a kill, merge, validation,
and one run of the whole workflow with the tiny transformers model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_workflow
from fakes.fake_http import Behaviour, FakeServer

from mirageflow.shard.manifest import from_ranges
from mirageflow.config import ConfigError, load_config, records_identity
from mirageflow.data.merge import merge_dataset
from mirageflow.shard.samples import sample_seed
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard


def _raw(tmp_path: Path, rows: list, processor: dict, n: int = 3, **processing) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "processors": [{"type": "llm", **processor}],
        "loading_params": {
            "state_dir": str(tmp_path / "state"),
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out"), "output_format": "jsonl"}],
        },
        "shard_params": {"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
        "processing_params": {
            "inputs": [{"name": "q", "key": "q"}],
            "outputs": [{"name": "a", "type": "llm", "prompt": "Answer {{ q }}"}],
            "n_samples": n,
            **processing,
        },
    }  # fmt: skip


def _openai(server: FakeServer) -> dict:
    return {"backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "m"}}


def _jsonl(directory: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(directory.glob("part-*.jsonl")) for line in p.read_text().splitlines() if line]


def _records(tmp_path: Path) -> list[dict]:
    return _jsonl(tmp_path / "out" / "shard_0")


def _keys(records) -> list[tuple[int, int]]:
    return [(r["source_index"], r["sample_index"]) for r in records]


# --------------------------------------------------------------------------- validation


def test_config_validation_names_the_key(tmp_path):
    base = _raw(tmp_path, [{"q": "x"}], {"server_args": {"model_path": "m"}})

    def problems(**pp):
        raw = json.loads(json.dumps(base))
        raw["processing_params"].update(pp)
        with pytest.raises(ConfigError) as e:
            load_config(raw, check_paths=False)
        return str(e.value)

    assert "processing_params.n_samples" in problems(n_samples=0)
    assert "'a' is also a field of processing_params.output_schema" in problems(
        preserve_columns=["a"], remove_columns=True, output_schema={"a": "{{ a }}"}
    )
    assert "'sample_index' is set by the workflow" in problems(preserve_columns=["sample_index"])
    greedy = json.loads(json.dumps(base))
    greedy["processors"][0]["default_sampling_params"] = {"temperature": 0}
    with pytest.raises(ConfigError, match=r"processing_params.n_samples: 3 samples per row, but every output decodes greedily"):
        load_config(greedy, check_paths=False)
    # n_samples 1 and no preserve_columns: the records' identity of a config without the keys
    plain = json.loads(json.dumps(base))
    del plain["processing_params"]["n_samples"]
    explicit = json.loads(json.dumps(plain))
    explicit["processing_params"].update(n_samples=1, preserve_columns=[])
    ident = records_identity(load_config(plain, check_paths=False))
    assert ident == records_identity(load_config(explicit, check_paths=False))
    assert "n_samples" not in json.dumps(ident)
    assert ident != records_identity(load_config(base, check_paths=False))  # n_samples 3 reruns shards


def test_preflight_refuses_a_preserved_column_no_row_has(tmp_path):
    from mirageflow.config.preflight import preflight_problems

    raw = _raw(tmp_path, [{"q": "x", "id": 1}], {"backend": "openai", "base_url": "http://h/v1", "server_args": {"model_path": "m"}},
               remove_columns=True, preserve_columns=["idd"], output_schema={"answer": "{{ a }}"})  # fmt: skip
    problems = [p for p in preflight_problems(load_config(raw)) if "preserve_columns" in p]
    assert problems == [
        f"processing_params.preserve_columns: 'idd' is a column of none of the first 1 rows of "
        f"loading_params.datasets[0] ('{tmp_path / 'in.jsonl'}') (did you mean 'id'?)"
    ]
    raw["processing_params"]["preserve_columns"] = ["id"]
    assert not [p for p in preflight_problems(load_config(raw)) if "preserve_columns" in p]


def test_seeds_differ_per_sample_and_row_and_are_stable():
    seeds = {(d, i, k): sample_seed(None, d, i, k) for d in range(2) for i in range(50) for k in range(4)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**31 + 4 for s in seeds.values())
    assert sample_seed(None, 0, 7, 1) == sample_seed(0, 0, 7, 1) != sample_seed(1, 0, 7, 1)
    # fixed forever (a change reseeds every rerun); a row's samples have consecutive seeds,
    # so one request with n and seed s is the same draw as n requests on vLLM (seed + i)
    assert sample_seed(None, 0, 7, 0) == 409108701 and sample_seed(None, 0, 7, 2) == 409108703


# --------------------------------------------------------------------------- shard runs (fake server across HTTP)


def _covered(bodies) -> list[int]:
    """The sample seeds a list of request bodies asked for (a request with n covers seed .. seed + n - 1)."""
    return sorted(b["seed"] + i for b in bodies for i in range(b.get("n", 1)))


def test_order_sample_index_seeds_per_sample_errors_and_merge(tmp_path):
    server = FakeServer(Behaviour(reject_seeds=frozenset({sample_seed(None, 0, 0, 1)}))).start()  # row 0's sample 1 is refused
    try:
        rows = [{"q": "a", "id": "A"}, {"q": "b", "id": "B"}, {"no_q": 1}]  # row 2 lacks the input: all its samples fail
        raw = _raw(tmp_path, rows, _openai(server), remove_columns=True, preserve_columns=["id"], output_schema={"answer": "{{ a }}"})
        raw["processors"][0]["native_n"] = False  # one request per sample
        raw["shard_params"]["max_inflight"] = 1
        cfg = load_config(raw)
        index_datasets(cfg)
        status = run_shard(cfg, 0)
        bodies = [r["body"] for r in server.records if r["path"] == "/v1/chat/completions"]
    finally:
        server.stop()

    records = sorted(_records(tmp_path), key=lambda r: (r["source_index"], r["sample_index"]))
    assert _keys(records) == [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [r["id"] for r in records] == ["A", "A", "B", "B", "B"] and set(records[0]) == {"id", "answer", "source_index", "sample_index"}
    errors = [json.loads(line) for line in (cfg.shard_dir(0) / "errors.jsonl").read_text().splitlines()]
    assert sorted((e["source_index"], e["sample_index"], e["error"]) for e in errors) == [
        (0, 1, "invalid_request"), (2, 0, "missing_variable"), (2, 1, "missing_variable"), (2, 2, "missing_variable"),
    ]  # fmt: skip
    ds = status["datasets"][0]
    assert (ds["rows_processed"], ds["rows_failed"]) == (5, 4)
    # one request per sample (row 2 sends none), each with its own seed
    assert sorted(b["seed"] for b in bodies) == sorted(sample_seed(None, 0, i, k) for i in range(2) for k in range(3))
    assert not any("n" in b for b in bodies)
    merged = merge_dataset(cfg, cfg.datasets[0])
    assert _keys(_jsonl(Path(merged["merged_dir"]))) == [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]  # x x y y y: by row, then sample

    # retry_failed_rows redoes the failed samples only: one request (row 2 fails before any)
    server = FakeServer().start()
    try:
        raw["processors"][0]["base_url"] = server.url + "/v1"
        raw["retry_failed_rows"] = True
        status = run_shard(load_config(raw), 0)
        assert [b["body"]["seed"] for b in server.records] == [sample_seed(None, 0, 0, 1)]
    finally:
        server.stop()
    assert sorted(_keys(_records(tmp_path))) == [(i, k) for i in range(2) for k in range(3)]
    assert (status["datasets"][0]["rows_processed"], status["datasets"][0]["rows_failed"]) == (6, 3)


_CHILD = """
import json, sys
from mirageflow.config import load_config
from mirageflow.shard.runner import run_shard
run_shard(load_config(json.load(open(sys.argv[1]))), 0)
"""


def test_kill_and_resume_redo_no_finished_sample_and_duplicate_none(tmp_path):
    rows, n = 8, 3
    server = FakeServer(Behaviour(latency=0.05)).start()
    try:
        raw = _raw(tmp_path, [{"q": f"row {i}"} for i in range(rows)], _openai(server), n=n)
        raw["shard_params"]["max_inflight"] = 2
        cfg = load_config(raw)
        index_datasets(cfg)
        cfg_file = tmp_path / "cfg.json"
        cfg_file.write_text(json.dumps(raw))
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(cfg_file)], env=env, stderr=subprocess.DEVNULL)
        manifest = cfg.shard_dir(0) / "checkpoint.json"
        deadline = time.monotonic() + 60
        committed: set[int] = set()
        while time.monotonic() < deadline and len(committed) < 6:
            time.sleep(0.05)
            try:
                committed = from_ranges(json.loads(manifest.read_text())["datasets"]["0"]["done"])
            except (FileNotFoundError, ValueError, KeyError):
                pass
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert 6 <= len(committed) < rows * n, "the kill should land mid-shard"
        committed = from_ranges(json.loads(manifest.read_text())["datasets"]["0"]["done"])  # as the kill left it
        before = len(server.records)
        status = run_shard(cfg, 0)
        resent = [r["body"] for r in server.records[before:]]
    finally:
        server.stop()
    # the rerun asked only for the samples not committed, each once (a row's pending
    # samples in one request with n: the openai backend's native n)
    todo = sorted(set(range(rows * n)) - committed)
    assert _covered(resent) == sorted(sample_seed(None, 0, u // n, u % n) for u in todo)
    assert len(resent) == len({u // n for u in todo})
    keys = _keys(_records(tmp_path))
    assert sorted(keys) == [(i, k) for i in range(rows) for k in range(n)]  # none missing, none twice
    assert status["datasets"][0]["rows_processed"] == rows * n
    assert status["stats"]["rows_resumed"] == len(committed)
    merge_dataset(cfg, cfg.datasets[0])


# --------------------------------------------------------------------------- native n (one request per row)


def _native_run(root: Path, rows: int, n: int, **processor) -> tuple[list[dict], list[dict], dict, FakeServer]:
    server = FakeServer(Behaviour(seed_in_text=True)).start()
    try:
        raw = _raw(root, [{"q": f"row {i} " + "w " * i} for i in range(rows)], {**_openai(server), **processor}, n=n)
        cfg = load_config(raw)
        index_datasets(cfg)
        status = run_shard(cfg, 0)
    finally:
        server.stop()
    records = sorted(_records(root), key=lambda r: (r["source_index"], r["sample_index"]))
    return records, [r["body"] for r in server.records], status, server


def test_native_n_one_request_per_row_is_the_same_draw_as_one_per_sample(tmp_path):
    (tmp_path / "native").mkdir()
    (tmp_path / "split").mkdir()
    records, bodies, status, server = _native_run(tmp_path / "native", rows=3, n=3)
    # one request per row, with n and the seed of the row's first sample
    assert sorted((b["seed"], b["n"]) for b in bodies) == sorted((sample_seed(None, 0, i, 0), 3) for i in range(3))
    assert _keys(records) == [(i, k) for i in range(3) for k in range(3)]
    # choice k is sample k, drawn with seed + k (as vLLM seeds a request's choices)
    assert [r["a"].rsplit(" s=", 1)[1] for r in records] == [str(sample_seed(None, 0, i, k)) for i in range(3) for k in range(3)]
    st = status["stats"]
    # the prompt was read once per request; the choices' tokens add up to the server's
    assert (st["requests"], st["input_tokens"], st["output_tokens"]) == (3, server.prompt_tokens, server.generation_tokens)
    assert st["rows_processed"] == 9

    split, split_bodies, split_status, split_server = _native_run(tmp_path / "split", rows=3, n=3, native_n=False)
    assert len(split_bodies) == 9 and not any("n" in b for b in split_bodies)
    assert [r["a"] for r in split] == [r["a"] for r in records]  # the same records either way
    assert split_status["stats"]["requests"] == 9 and split_status["stats"]["output_tokens"] == st["output_tokens"]
    assert split_status["stats"]["input_tokens"] == split_server.prompt_tokens == 3 * server.prompt_tokens


def test_native_n_asks_for_each_run_of_pending_samples(tmp_path):
    n = 4
    failing = frozenset(sample_seed(None, 0, 0, k) for k in (0, 1, 3))
    server = FakeServer(Behaviour(reject_seeds=failing)).start()
    try:
        raw = _raw(tmp_path, [{"q": "a"}, {"q": "b"}], {**_openai(server), "native_n": False}, n=n)
        cfg = load_config(raw)
        index_datasets(cfg)
        run_shard(cfg, 0)
    finally:
        server.stop()
    assert sorted(_keys(_records(tmp_path))) == [(0, 2)] + [(1, k) for k in range(n)]
    server = FakeServer().start()  # retry the failed samples 0, 1 and 3 of row 0, with native n
    try:
        raw["processors"][0].update(base_url=server.url + "/v1", native_n=None)
        raw["retry_failed_rows"] = True
        status = run_shard(load_config(raw), 0)
        bodies = sorted((r["body"] for r in server.records), key=lambda b: b["seed"])
    finally:
        server.stop()
    # samples 0-1 in one request with n=2, sample 3 alone: each seed as one request per sample would have
    assert [(b["seed"], b.get("n")) for b in bodies] == [(sample_seed(None, 0, 0, 0), 2), (sample_seed(None, 0, 0, 3), None)]
    assert sorted(_keys(_records(tmp_path))) == [(i, k) for i in range(2) for k in range(n)]
    assert status["datasets"][0]["rows_processed"] == 2 * n


def test_native_n_on_a_server_without_n_fails_the_shard_naming_the_key(tmp_path):
    server = FakeServer(Behaviour(ignore_n=True)).start()
    try:
        cfg = load_config(_raw(tmp_path, [{"q": "a"}], _openai(server), n=2))
        index_datasets(cfg)
        with pytest.raises(
            ShardFailed,
            match=r"n=2 with choice indexes \[0\], not 0..1 once each: the server does not support n; set processors\[\]\.native_n: false",
        ):
            run_shard(cfg, 0)
    finally:
        server.stop()
    assert not _records(tmp_path)


@pytest.mark.parametrize(
    "choices",
    [
        [{"index": 0}, {"index": 0}],  # a repeated index: sample 1 would be lost
        [{"index": "0"}, {"index": 1}],  # an index of the wrong type
        [{"index": 0}, "not a choice"],
        [{"index": 1}, {"index": 2}],
    ],
)
def test_native_n_refuses_choices_that_are_not_one_per_sample(tmp_path, monkeypatch, choices):
    from mirageflow.engines import openai_engine
    from mirageflow.engines.wire import Request
    from mirageflow.engines.http import EngineError

    class Answer:
        status_code = 200

        def json(self):
            return {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 4}}

    async def post(*args, **kwargs):
        return Answer()

    monkeypatch.setattr(openai_engine, "post_with_retries", post)
    cfg = load_config(
        _raw(tmp_path, [{"q": "a"}], {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "server_args": {"model_path": "m"}}, n=2),
        check_paths=False,
    )
    engine = openai_engine.OpenAIEngine(cfg.processors["llm"])
    engine.load()
    try:
        request = Request(0, [{"role": "user", "content": "q"}], None, {}, seed=5)
        with pytest.raises(EngineError, match=r"not 0..1 once each: the server does not support n"):
            asyncio.run(engine.generate_samples(request, 2))
    finally:
        engine.close()


def test_native_n_is_refused_on_a_backend_without_it(tmp_path):
    raw = _raw(tmp_path, [{"q": "a"}], {"backend": "transformers", "server_args": {"model_path": "m"}, "native_n": True})
    with pytest.raises(
        ConfigError,
        match=r"processors\[0\]\.native_n: only the openai and vllm_server backends send one request with n; backend 'transformers'",
    ):
        load_config(raw, check_paths=False)
    raw["processors"][0]["native_n"] = False
    load_config(raw, check_paths=False)


def test_accounting_refuses_a_missing_sample(tmp_path):
    from mirageflow.shard.checkpoint import Checkpoint
    from mirageflow.shard.accounting import check_accounting

    cfg = load_config(_raw(tmp_path, [{"q": "a"}, {"q": "b"}], {"server_args": {"model_path": "m"}}, n=2), check_paths=False)
    cp = Checkpoint(tmp_path / "state", "f", {0: (tmp_path / "out", "jsonl")}, samples=2)
    cp.datasets[0].done = {0, 1, 2}  # row 1's sample 1 neither written nor recorded
    piece = type("Slice", (), {"start": 0, "stop": 2})()
    with pytest.raises(ShardFailed, match=r"rows \[0, 2\) x 2 samples should be 4 .*'row 1 sample 1'"):
        check_accounting(cfg, cp, [piece], 0)
    cp.datasets[0].done.add(3)
    assert check_accounting(cfg, cp, [piece], 0)[0]["rows_processed"] == 4


# --------------------------------------------------------------------------- the real tiny model


def _tiny(tmp_path: Path, model: Path, rows: int, n: int) -> dict:
    processor = {
        "backend": "transformers", "server_args": {"model_path": str(model)},
        "default_sampling_params": {"temperature": 1.0, "max_new_tokens": 6},
    }  # fmt: skip
    return _raw(tmp_path, [{"q": f"question {i}"} for i in range(rows)], processor, n=n)


def test_transformers_samples_differ_and_a_rerun_reproduces_them(tmp_path, tiny_model):
    texts = []
    for attempt in ("first", "second"):
        root = tmp_path / attempt
        root.mkdir()
        cfg = load_config(_tiny(root, tiny_model, rows=2, n=3))
        index_datasets(cfg)
        run_shard(cfg, 0)
        records = sorted(_records(root), key=lambda r: (r["source_index"], r["sample_index"]))
        assert _keys(records) == [(i, k) for i in range(2) for k in range(3)]
        texts.append([r["a"] for r in records])
    assert texts[0] == texts[1]  # seeds stable across reruns
    assert len(set(texts[0][:3])) > 1 and len(set(texts[0][3:])) > 1  # samples of a row differ


def test_workflow_end_to_end(tmp_path, tiny_model):
    raw = _tiny(tmp_path, tiny_model, rows=5, n=2)
    raw["loading_params"]["num_shards"] = 2
    raw["loading_params"]["state_dir"] = "state"
    raw["loading_params"]["datasets"][0]["output_dir"] = "out"
    raw["processing_params"].update(remove_columns=True, preserve_columns=["q"], output_schema={"answer": "{{ a }}"})
    raw["execution_params"] = {"merge": True}
    run_workflow(tmp_path, raw)
    merged = _jsonl(tmp_path / "out" / "merged")
    assert _keys(merged) == [(i, k) for i in range(5) for k in range(2)]
    assert [r["q"] for r in merged] == [f"question {i // 2}" for i in range(10)]
    metrics = json.loads((tmp_path / "state" / "metrics.json").read_text())
    assert metrics["aggregate"]["total_rows_processed"] == 10  # records: rows x samples


# --------------------------------------------------------------------------- units: rows and samples apart (issue 23 items 1, 5)


def test_progress_counts_rows_and_samples_apart(tmp_path):
    server = FakeServer().start()
    try:
        cfg = load_config(_raw(tmp_path, [{"q": f"row {i}"} for i in range(4)], _openai(server), n=3))
        index_datasets(cfg)
        run_shard(cfg, 0)
    finally:
        server.stop()
    progress = json.loads((cfg.shard_dir(0) / "progress.json").read_text())
    assert (progress["rows_done"], progress["rows_total"], progress["n_samples"]) == (4, 4, 3)
    assert (progress["samples_done"], progress["samples_total"], progress["samples_committed"]) == (12, 12, 12)
    assert progress["fraction_done"] == 1.0


def test_an_interrupted_shard_says_what_it_committed_as_its_resume_does_and_counts_its_attempts(tmp_path, caplog):
    """SIGTERM's failure.json and the resume's log line name the same committed work (filtered
    rows included, in samples and complete rows), and the two attempts are numbered 1 and 2."""
    rows, n = 12, 2
    server = FakeServer(Behaviour(latency=0.05)).start()
    try:
        raw = _raw(tmp_path, [{"q": f"row {i}"} for i in range(rows)], _openai(server), n=n)
        raw["processing_params"]["outputs"].insert(0, {"name": "keep", "type": "filter", "predicate": "q != 'row 0' and q != 'row 1'"})
        raw["shard_params"]["max_inflight"] = 2
        cfg = load_config(raw)
        index_datasets(cfg)
        cfg_file = tmp_path / "cfg.json"
        cfg_file.write_text(json.dumps(raw))
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(cfg_file)], env=env, stderr=subprocess.DEVNULL)
        manifest = cfg.shard_dir(0) / "checkpoint.json"
        deadline = time.monotonic() + 60
        done: set[int] = set()
        while time.monotonic() < deadline and len(done) < 6:
            time.sleep(0.05)
            try:
                done = from_ranges(json.loads(manifest.read_text())["datasets"]["0"]["done"])
            except (FileNotFoundError, ValueError, KeyError):
                pass
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) != 0
        failure = json.loads((cfg.shard_dir(0) / "failure.json").read_text())
        assert failure["signal"] == "SIGTERM"
        committed = failure["error"].split("; ", 1)[1].split(" committed, rerun to resume")[0]
        assert committed.endswith("rows complete)") and " samples (" in committed  # "10 samples (5 rows complete)"
        caplog.set_level("INFO", logger="mirageflow.shard.runner")
        status = run_shard(cfg, 0)
    finally:
        server.stop()
    assert f"resuming shard 0: {committed} already committed are skipped" in caplog.text
    assert [a["attempt"] for a in status["stats"]["attempts"]] == [1, 2] and status["attempt"] == 2
    assert status["stats"]["rows_filtered"] == 2 * n and status["stats"]["n_samples"] == n
