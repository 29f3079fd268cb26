"""processors of type batch_api: OpenAI Batch and Anthropic Message Batches as a shard engine,
against a stand-in of both APIs on 127.0.0.1 (tests/fakes/fake_batch_api.py): chunks within
the limits, row errors with classes, tokens and batch ids in status.json, MMIRAGE's receipts,
expired and cancelled batches resubmitted once, a refused batch, and a shard killed between
submitting and the results that re-attaches on rerun instead of paying twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fakes.fake_batch_api import FakeBatchAPI, Trouble

from mirageflow.cluster.resources import cluster_resources, shard_gpus
from mirageflow.config import ConfigError, load_config
from mirageflow.config.preflight import preflight_problems
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard

KEY = "sk-test"
PROVIDERS = ["openai", "anthropic"]
ROWS = 12
MARKERS = {3: "FAIL_CONTEXT", 4: "FAIL_POLICY", 5: "FAIL_RATE", 6: "FAIL_SERVER"}
CLASSES = {3: "context_length", 4: "content_filter", 5: "rate_limited", 6: "provider_error"}


@pytest.fixture
def api(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BATCH_TEST_KEY", KEY)
    server = FakeBatchAPI(Trouble(polls_to_end=2)).start()
    yield server
    server.trouble.hold.clear()
    server.stop()


def _rows(path: Path, n: int = ROWS, markers: dict | None = None) -> Path:
    markers = MARKERS if markers is None else markers
    path.write_text("".join(json.dumps({"text": f"passage {i} " + markers.get(i, "")}) + "\n" for i in range(n)))
    return path


def _config(tmp_path: Path, api: FakeBatchAPI, provider: str, **processor) -> dict:
    base = api.url + ("/v1" if provider == "openai" else "")
    return {
        "processors": [
            {
                "type": "batch_api",
                "provider": provider,
                "model": "test-model",
                "base_url": base,
                "api_key_env": "BATCH_TEST_KEY",
                "poll_seconds": 0.05,
                "poll_max_seconds": 0.2,
                **processor,
            }
        ],  # fmt: skip
        "loading_params": {
            "datasets": [{"path": str(_rows(tmp_path / "in.jsonl")), "type": "JSONL", "output_dir": str(tmp_path / "out")}],
            "state_dir": str(tmp_path / "state"),
            "num_shards": 1,
        },  # fmt: skip
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [
                {
                    "name": "qa",
                    "type": "batch_api",
                    "output_type": "JSON",
                    "output_schema": ["question", "answer"],
                    "prompt": "Ask about {{ text }}",
                }
            ],
            "remove_columns": True,
            "output_schema": {"q": "{{ qa.question }}", "a": "{{ qa.answer }}"},
        },
        "shard_params": {"max_error_rate": 0.5, "checkpoint_rows": 4},
    }


def _run(raw: dict) -> dict:
    cfg = load_config(raw)
    index_datasets(cfg)
    return run_shard(cfg, 0)


def _records(tmp_path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return sorted(
        (r for f in sorted((tmp_path / "out" / "shard_0").glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()),
        key=lambda r: r["source_index"],
    )


def _errors(tmp_path: Path) -> dict[int, str]:
    lines = (tmp_path / "state" / "shard_0" / "errors.jsonl").read_text().splitlines()
    return {e["source_index"]: e["error"] for e in map(json.loads, lines)}


def _ledger(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "state" / "shard_0" / "batches.json").read_text())["batches"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_shard_through_the_batch_api_with_chunks_row_errors_tokens_and_receipts(tmp_path, api, provider):
    raw = _config(tmp_path, api, provider, max_requests_per_chunk=5, metadata_output_path=str(tmp_path / "meta" / "batch_metadata.jsonl"))
    status = _run(raw)
    records, errors = _records(tmp_path), _errors(tmp_path)
    # rows in = records + row errors, each row once; the provider's error codes become classes
    assert sorted([r["source_index"] for r in records] + list(errors)) == list(range(ROWS))
    assert errors == CLASSES
    assert all(r["q"].startswith("question of u") and r["a"].startswith("answer of u") for r in records)
    # chunks within max_requests_per_chunk: 12 requests -> at least 3 batches, all recorded
    ledger = _ledger(tmp_path)
    assert api.batches_created == len(ledger) >= 3 and all(e["requests"] <= 5 and e["state"] == "ended" for e in ledger.values())
    assert sum(e["requests"] for e in ledger.values()) == ROWS
    batches = status["engines"]["batch_api"]["details"]["batches"]
    assert sorted(b["batch_id"] for b in batches) == sorted(api.batches)
    # token usage: the provider's, summed over the rows that ran
    stats = status["stats"]
    assert stats["output_tokens"] > 0 and stats["output_tokens"] == sum(e["output_tokens"] for e in ledger.values())
    # MMIRAGE's receipts: one line per batch, custom ids mapped to source indices
    receipts = [json.loads(x) for x in (tmp_path / "meta" / "batch_metadata.shard_0.jsonl").read_text().splitlines()]
    assert sorted(r["provider_batch_id"] for r in receipts) == sorted(api.batches)
    assert sorted(i for r in receipts for i in r["custom_id_to_source_index"].values()) == list(range(ROWS))
    assert all(r["provider"] == provider and r["total_bytes"] > 0 for r in receipts)
    # the key is read from the environment and written nowhere
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("provider", PROVIDERS)
def test_max_chunk_bytes_splits_and_an_oversized_request_goes_alone_or_fails_its_row(tmp_path, api, provider):
    raw = _config(tmp_path, api, provider, max_chunk_bytes=1500)
    _rows(tmp_path / "in.jsonl", markers={2: "x" * 3000})  # row 2's request alone is above 1500 bytes
    _run(raw)
    ledger = _ledger(tmp_path)
    big = [e for e in ledger.values() if e["bytes"] > 1500]
    assert len(big) == 1 and big[0]["requests"] == 1 and big[0]["flush_reason"] == "oversized"
    assert all(e["bytes"] <= 1500 for e in ledger.values() if e is not big[0])
    assert len(_records(tmp_path)) == ROWS

    rejecting = tmp_path / "reject"
    rejecting.mkdir()
    raw = _config(rejecting, api, provider, max_chunk_bytes=1500, oversized_request_policy="reject")
    _rows(rejecting / "in.jsonl", markers={2: "x" * 3000})
    _run(raw)
    assert _errors(rejecting) == {2: "request_too_large"} and len(_records(rejecting)) == ROWS - 1


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_expired_batch_is_submitted_once_more_for_its_missing_rows(tmp_path, api, provider):
    api.trouble.expire = {1}  # the first batch runs half its requests, then expires
    raw = _config(tmp_path, api, provider)
    _rows(tmp_path / "in.jsonl", markers={})
    _run(raw)
    ledger = sorted(_ledger(tmp_path).values(), key=lambda e: e["sealed_at"])
    assert api.batches_created == 2
    assert [(e["round"], e["requests"]) for e in ledger] == [(0, ROWS), (1, ROWS - ROWS // 2)]
    assert len(_records(tmp_path)) == ROWS  # the second submission ran them


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("how", ["expire", "cancel"])
def test_rows_a_batch_misses_twice_are_row_errors(tmp_path, api, provider, how):
    if how == "expire":
        api.trouble.expire = "all"
    else:
        api.trouble.cancel_at_end = {1, 2}
    raw = _config(tmp_path, api, provider)
    _rows(tmp_path / "in.jsonl", markers={})
    raw["shard_params"]["max_error_rate"] = 1.0
    status = _run(raw)
    errors = _errors(tmp_path)
    assert status["stats"]["rows_failed"] == len(errors)
    ran_first = ROWS // 2
    missed_twice = (ROWS - ran_first) - (ROWS - ran_first) // 2
    assert api.batches_created == 2 and len(errors) == missed_twice
    assert set(errors.values()) == {"batch_expired" if how == "expire" else "batch_cancelled"}
    assert len(_records(tmp_path)) + len(errors) == ROWS


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_result_line_of_another_shape_fails_its_row_and_one_prompt_twice_is_sent_once(tmp_path, api, provider):
    raw = _config(tmp_path, api, provider)
    _rows(tmp_path / "in.jsonl", markers={2: "GARBAGE_LINE"})
    outputs = raw["processing_params"]["outputs"]
    outputs.append({**outputs[0], "name": "again"})  # the same prompt: the same request
    raw["processing_params"]["output_schema"]["a2"] = "{{ again.answer }}"
    _run(raw)
    assert _errors(tmp_path) == {2: "provider_error"}
    assert api.requests_seen == ROWS  # each request once, though two outputs asked it
    assert all(r["a"] == r["a2"] for r in _records(tmp_path))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_token_figures_that_are_not_counts_fail_their_row_and_a_rerun_answers_the_same(tmp_path, api, provider):
    """usage 1e999 (Python reads inf) and -12000: those rows fail as bad_answer, a line nested
    deeper than Python parses as provider_error, the other rows and the token figures are whole; a retry of the failed rows reads the same saved results
    and fails them the same way, submitting nothing."""
    raw = _config(tmp_path, api, provider)
    _rows(tmp_path / "in.jsonl", markers={2: "USAGE_HUGE", 5: "USAGE_NEGATIVE", 8: "DEEP_LINE"})
    status = _run(raw)
    # a line nested past Python's parser is no answer: submitted once more, then the row's error
    expected = {2: "bad_answer", 5: "bad_answer", 8: "provider_error"}
    assert _errors(tmp_path) == expected
    assert len(_records(tmp_path)) == ROWS - 3
    ledger = _ledger(tmp_path)
    for figures in [status["stats"], *ledger.values()]:
        assert all(isinstance(figures[k], int) and figures[k] >= 0 for k in ("input_tokens", "output_tokens")), figures
    assert status["stats"]["output_tokens"] == sum(e["output_tokens"] for e in ledger.values()) > 0
    created = api.batches_created
    status = _run({**raw, "retry_failed_rows": True})
    assert api.batches_created == created
    assert _errors(tmp_path) == expected and len(_records(tmp_path)) == ROWS - 3


@pytest.mark.parametrize("provider", PROVIDERS)
def test_duplicate_and_unknown_result_lines_are_counted_once_and_reported(tmp_path, api, provider, caplog):
    """A custom_id answered twice keeps its first line and its tokens count once; lines for
    custom_ids never submitted are ignored; both are counted in the batch's entry and warned
    about with the batch id and the custom_id."""
    api.trouble.stranger_lines = 2
    raw = _config(tmp_path, api, provider)
    _rows(tmp_path / "in.jsonl", markers={3: "DUPLICATE_LINE"})
    with caplog.at_level("WARNING"):
        status = _run(raw)
    assert _errors(tmp_path) == {} and len(_records(tmp_path)) == ROWS
    ((entry),) = _ledger(tmp_path).values()
    assert entry["duplicate_results"] == 1 and entry["unknown_results"] == 2 and entry["results"] == ROWS
    per_row = status["stats"]["output_tokens"]  # each row's answer once: the runner's sum
    assert entry["output_tokens"] == per_row
    (batch,) = status["engines"]["batch_api"]["details"]["batches"]
    assert batch["duplicate_results"] == 1 and batch["unknown_results"] == 2
    said = caplog.text
    assert f"batch {entry['batch_id']}" in said and "duplicate result line" in said and "u3-" in said
    assert "never submitted" in said and "u900-" in said


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_edit_that_leaves_the_requests_unchanged_submits_nothing_again(tmp_path, api, provider):
    """No temperature set (MMIRAGE's default: the request cache keeps no unseeded answer):
    an edit of the record template (output_schema) changes the records' fingerprint but no
    request's bytes, so the rerun is answered by the batches already paid for; a prompt
    edit of one row then submits that row's request only. (Anthropic's requests here sample
    at 0.7: not greedy either, so no answer of the request cache can stand in for a batch.)"""
    raw = _config(tmp_path, api, provider, **({"temperature": 0.7} if provider == "anthropic" else {}))
    _rows(tmp_path / "in.jsonl", markers={})
    _run(raw)
    assert api.requests_seen == ROWS
    raw["processing_params"]["output_schema"]["q_again"] = "{{ qa.question }}"
    _run(raw)
    assert api.requests_seen == ROWS, "an output_schema edit submitted byte-identical requests again"
    records = _records(tmp_path)
    assert len(records) == ROWS and all(r["q_again"] == r["q"] for r in records)
    _rows(tmp_path / "in.jsonl", markers={7: "edited"})
    _run(raw)
    assert api.requests_seen == ROWS + 1 and len(_records(tmp_path)) == ROWS


def test_a_batch_openai_refuses_fails_its_rows_as_batch_rejected(tmp_path, api):
    api.trouble.refuse = {1}
    raw = _config(tmp_path, api, "openai")
    _rows(tmp_path / "in.jsonl", markers={})
    raw["shard_params"]["max_error_rate"] = 1.0
    with pytest.raises(ShardFailed, match="every row failed|rows failed"):
        _run(raw)
    errors = _errors(tmp_path)
    assert set(errors) == set(range(ROWS)) and set(errors.values()) == {"batch_rejected"}
    message = json.loads((tmp_path / "state" / "shard_0" / "errors.jsonl").read_text().splitlines()[0])["message"]
    assert "does not support the Batch API" in message


def test_a_wrong_key_fails_the_shard_naming_the_endpoint(tmp_path, api, monkeypatch):
    monkeypatch.setenv("BATCH_TEST_KEY", "sk-wrong")
    with pytest.raises(ShardFailed, match="HTTP 401.*check the API key"):
        _run(_config(tmp_path, api, "openai"))
    assert api.batches_created == 0


# --------------------------------------------------------------------------- kill, then re-attach


def _start_shard(tmp_path: Path, raw: dict) -> subprocess.Popen:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [sys.executable, "-m", "mirageflow.jobs", "--config", str(path), "--log", str(tmp_path / "shard.log"), "shard", "0"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(what, deadline: float = 60.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_shard_killed_between_submit_and_results_reattaches_instead_of_paying_twice(tmp_path, api, provider):
    api.trouble.hold.set()  # the batches run until the test lets them end
    raw = _config(tmp_path, api, provider, max_requests_per_chunk=5)
    _rows(tmp_path / "in.jsonl", markers={4: "FAIL_POLICY"})
    cfg = load_config(raw)
    index_datasets(cfg)
    shard = _start_shard(tmp_path, raw)
    ledger = tmp_path / "state" / "shard_0" / "batches.json"

    def submitted():
        try:
            entries = json.loads(ledger.read_text())["batches"]
        except (OSError, ValueError):
            return None
        return entries if len(entries) == 3 and all(e.get("state") == "submitted" for e in entries.values()) else None

    entries = _wait_for(submitted)
    assert api.batches_created == 3  # every batch id was recorded before the shard waited
    shard.send_signal(signal.SIGKILL)
    shard.wait(timeout=30)
    assert not (tmp_path / "state" / "shard_0" / "status.json").exists()

    api.trouble.hold.clear()  # meanwhile the provider finishes the batches
    status = run_shard(cfg, 0)  # the rerun
    assert api.batches_created == 3, "the rerun submitted its rows again instead of waiting for its batches"
    assert status["engines"]["batch_api"]["details"]["batches_reattached"] == 3
    assert sorted(b["batch_id"] for b in status["engines"]["batch_api"]["details"]["batches"]) == sorted(
        e["batch_id"] for e in entries.values()
    )
    records, errors = _records(tmp_path), _errors(tmp_path)
    assert errors == {4: "content_filter"} and len(records) == ROWS - 1
    assert status["stats"]["output_tokens"] == sum(e["output_tokens"] for e in _ledger(tmp_path).values()) > 0


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_request_asked_while_its_batchs_end_is_recorded_is_answered_not_paid_again(tmp_path, api, provider, monkeypatch):
    """The moment a chunk's entry says ``ended`` (the ledger's record, in memory before its
    file is written), a row asking for its request (a rerun's row beside a re-attached batch)
    is answered from the saved results: were they indexed only after the record, it would
    find no answer, submit the request once more and pay for it twice."""
    from mirageflow.engines import batch_results
    from mirageflow.engines.batch_chunks import unit_of
    from mirageflow.shard.ledger import BatchLedger

    results_of: dict[int, batch_results.BatchResults] = {}  # id(ledger) -> the engine's results
    init = batch_results.BatchResults.__init__

    def remembered(self, ledger, prov):
        init(self, ledger, prov)
        results_of[id(ledger)] = self

    record, asked = BatchLedger.record, []

    def ask_while_recording(self, key, **fields):
        record(self, key, **fields)  # the entry says ended from here on
        if fields.get("state") == "ended":
            results = results_of[id(self)]
            for line in self.results(key).read_text().splitlines():
                cid = json.loads(line)["custom_id"]
                asked.append((cid, results.stored(cid, unit_of(cid)).retry))

    monkeypatch.setattr(batch_results.BatchResults, "__init__", remembered)
    monkeypatch.setattr(BatchLedger, "record", ask_while_recording)
    _run(_config(tmp_path, api, provider, max_requests_per_chunk=5))
    assert len(asked) == ROWS  # every request was asked for in its batch's window
    assert [cid for cid, retry in asked if retry is not None] == [], "requests that would have been submitted and paid again"
    assert api.requests_seen == ROWS


def test_a_chunk_sealed_but_never_recorded_as_created_is_found_by_its_key(tmp_path, api):
    """The shard died after OpenAI created the batch and before its id was recorded: the
    rerun finds it by its metadata (mirageflow_chunk) instead of creating another."""
    api.trouble.hold.set()
    raw = _config(tmp_path, api, "openai")
    _rows(tmp_path / "in.jsonl", markers={})
    cfg = load_config(raw)
    index_datasets(cfg)
    shard = _start_shard(tmp_path, raw)
    ledger = tmp_path / "state" / "shard_0" / "batches.json"
    _wait_for(lambda: ledger.exists() and "submitted" in ledger.read_text())
    shard.send_signal(signal.SIGKILL)
    shard.wait(timeout=30)
    saved = json.loads(ledger.read_text())
    ((key, entry),) = saved["batches"].items()
    saved["batches"][key] = {k: v for k, v in entry.items() if k not in ("batch_id", "submitted_at", "submitted_ts")} | {"state": "sealed"}
    ledger.write_text(json.dumps(saved))
    api.trouble.hold.clear()
    run_shard(cfg, 0)
    assert api.batches_created == 1
    assert _ledger(tmp_path)[key]["adopted"] is True and len(_records(tmp_path)) == ROWS


# --------------------------------------------------------------------------- config and cluster


def _raw(**processor) -> dict:
    return {
        "processors": [{"type": "batch_api", "provider": "openai", **processor}],
        "loading_params": {"datasets": [{"path": "in.jsonl", "type": "JSONL", "output_dir": "out"}]},
        "processing_params": {"inputs": [{"name": "t", "key": "t"}], "outputs": [{"name": "a", "type": "batch_api", "prompt": "{{ t }}"}]},
    }


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"max_chunk_bytes": 300_000_000}, "processors[0].max_chunk_bytes: 300000000 is above openai's limit of 200000000"),
        ({"max_requests_per_chunk": 60_000}, "processors[0].max_requests_per_chunk: 60000 is above openai's limit of 50000"),
        ({"provider": "anthropic", "temperature": 0.2, "top_p": 0.9}, "processors[0]: temperature and top_p are both set"),
        ({"provider": "anthropic", "completion_window": "24h"}, "processors[0].completion_window: a setting of the other provider's"),
        ({"server_args": {"model_path": "x"}}, "processors[0].server_args: a batch_api processor loads no model"),
        ({"backend": "openai"}, "processors[0].backend: a batch_api processor sends its requests"),
        ({"external": {"base_url": "http://x"}}, "processors[0].external: only image_gen processors have external"),
    ],
)
def test_batch_config_mistakes_are_refused_with_the_key(change, problem):
    with pytest.raises(ConfigError) as e:
        load_config(_raw(**change), check_paths=False)
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_defaults_mmirage_keys_and_a_response_prefix_only_where_the_provider_continues_one():
    cfg = load_config(_raw(), check_paths=False)
    p = cfg.processors["batch_api"]
    assert (p.backend, p.model, p.api_key_env, p.batch.max_chunk_bytes, p.batch.max_requests_per_chunk) == (
        "batch_api", "gpt-4.1-mini", "OPENAI_API_KEY", 52428800, 50000,
    )  # fmt: skip
    raw = _raw(provider="anthropic", max_tokens=100)
    cfg = load_config(raw, check_paths=False)
    p = cfg.processors["batch_api"]
    assert (p.model, p.api_key_env, p.sampling_params, p.batch.max_requests_per_chunk) == (
        "claude-haiku-4-5",
        "ANTHROPIC_API_KEY",
        {"temperature": 0.0},
        100000,
    )
    raw["processing_params"]["outputs"][0]["response_prefix"] = '{"a": '
    load_config(raw, check_paths=False)  # Anthropic continues a last assistant message
    raw = _raw()
    raw["processing_params"]["outputs"][0]["response_prefix"] = '{"a": '
    with pytest.raises(ConfigError, match="outputs\\[0\\].response_prefix: OpenAI's chat completions cannot continue"):
        load_config(raw, check_paths=False)


def test_a_batch_shard_is_a_cpu_job_whose_time_limit_covers_the_completion_window():
    cfg = load_config(_raw(), check_paths=False)
    assert shard_gpus(cfg) == 0
    res = cluster_resources(cfg, "shard")
    assert "gpu" not in res and "gres" not in res and res["cpus_per_task"] == 1
    assert res["runtime"](None, 1) == 25 * 60 and "--signal=TERM@300" in res["slurm_extra"]
    raw = _raw()
    raw["execution_params"] = {"max_time_limit": "04:00:00", "time_limit": "01:00:00"}
    res = cluster_resources(load_config(raw, check_paths=False), "shard")
    assert res["runtime"](None, 1) == 240  # capped: a retry re-attaches and waits on
    raw["execution_params"] = {"gpus": 2}
    with pytest.raises(ConfigError, match="execution_params.gpus: the shards of this pipeline only wait on a batch API"):
        load_config(raw, check_paths=False)


def test_preflight_refuses_an_unset_key_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    (tmp_path / "in.jsonl").write_text('{"t": "x"}\n')
    raw = _raw()
    raw["loading_params"]["datasets"][0].update(path=str(tmp_path / "in.jsonl"), output_dir=str(tmp_path / "out"))
    problems = preflight_problems(load_config(raw), environ={})
    assert any(p.startswith("processors[0].api_key_env: environment variable $OPENAI_API_KEY is not set") for p in problems), problems


def test_preview_shows_the_requests_and_does_not_submit_a_batch(tmp_path, api):
    from mirageflow.shard.preview import preview

    cfg = load_config(_config(tmp_path, api, "anthropic"))
    result = preview(cfg, rows=2)
    messages = result["datasets"][0]["rows"][0]["outputs"][0]["messages"]
    assert messages == [{"role": "user", "content": "Ask about passage 0 "}]
    with pytest.raises(RuntimeError, match="batch API, whose answers take up to 24 h: preview without --generate"):
        preview(cfg, rows=2, generate=True)
    assert api.batches_created == 0


# --------------------------------------------------------------------------- the key, the transport (issue 33)


@pytest.mark.parametrize("how", ["results_url", "redirect"])
def test_anthropic_results_on_another_origin_are_fetched_without_the_key(tmp_path, api, how):
    """Issue 33 item 1: a results_url on another port, or a 302 there, receives no x-api-key."""
    from fakes.fake_batch_api import ResultsHost

    stranger = ResultsHost(api).start()
    try:
        if how == "results_url":
            api.trouble.results_base = stranger.url
        else:
            api.trouble.results_redirect = stranger.url
        _run(_config(tmp_path, api, "anthropic"))
        assert stranger.headers_seen, "the results were not fetched from the other origin"
        for headers in stranger.headers_seen:
            assert "x-api-key" not in headers and "authorization" not in headers, headers
        assert len(_records(tmp_path)) + len(_errors(tmp_path)) == ROWS
    finally:
        stranger.stop()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_api_key_env_takes_precedence_over_userinfo_in_base_url(tmp_path, api, provider):
    """Issue 33 item 3: base_url http://user:pw@host with api_key_env sends the key, not Basic auth."""
    raw = _config(tmp_path, api, provider)
    raw["processors"][0]["base_url"] = raw["processors"][0]["base_url"].replace("http://", "http://user:pw@")
    _run(raw)
    assert len(_records(tmp_path)) + len(_errors(tmp_path)) == ROWS and api.batches_created >= 1
    assert api.authorization_seen and not any((auth or "").startswith("Basic") for auth in api.authorization_seen)


@pytest.mark.parametrize("provider,status", [("openai", 404), ("anthropic", 404), ("openai", 401), ("anthropic", 403)])
def test_a_batch_the_provider_refuses_to_poll_fails_the_shard_with_the_command_that_submits_again(tmp_path, api, provider, status):
    """Issue 33 item 6: an unknown batch id (404) or a refused key (401/403) on a status poll is
    permanent: the shard fails at once, naming batches.json, the batch id and the command that
    submits again; that command's ledger change makes the rerun submit the requests again."""
    from fakes.deadlines import run_with_deadline

    raw = _config(tmp_path, api, provider)
    api.trouble.poll_status = status
    finished, result = run_with_deadline(lambda: _run(raw), 120)  # a guard against the old endless polling, not a timing
    assert finished, "the shard kept polling a batch the provider answers permanently about"
    assert isinstance(result, ShardFailed), result
    (entry,) = _ledger(tmp_path).values()
    message = str(result)
    assert str(tmp_path / "state" / "shard_0" / "batches.json") in message and entry["batch_id"] in message
    assert f"mmirage retry --config <your config> --resubmit-batch {entry['batch_id']}" in message
    assert f"HTTP {status}" in message and api.polls <= 3
    # the command's change: the batch is abandoned, the rerun submits its requests again and finishes
    from mirageflow.cli import resubmit_batch, retry_plan
    from mirageflow.state.layout import StateLayout

    cfg = load_config(raw)
    assert resubmit_batch(cfg, StateLayout(cfg.state_dir), retry_plan(cfg, False), entry["batch_id"]) == 0
    assert _ledger(tmp_path)[next(iter(_ledger(tmp_path)))]["state"] == "abandoned"
    api.trouble.poll_status = None
    _run(raw)
    assert api.batches_created == 2 and len(_records(tmp_path)) + len(_errors(tmp_path)) == ROWS


def test_an_output_file_that_answers_404_says_the_file_is_gone_not_the_key(tmp_path, api):
    """Issue 33 item 14: a batch output file answering 404 does not blame the key or base_url."""
    api.trouble.file_status = 404
    with pytest.raises(ShardFailed) as failed:
        _run(_config(tmp_path, api, "openai"))
    message = str(failed.value)
    assert "HTTP 404" in message and "no longer has this file" in message and "output_file_id" in message
    assert "check the API key" not in message and "check base_url" not in message
    assert "batches.json" in message and "--resubmit-batch" in message


# --------------------------------------------------------------------------- budget


@pytest.mark.parametrize("booking_lost", [False, True])
def test_the_budget_holds_a_batch_before_it_is_submitted_and_books_it_once_across_attempts(tmp_path, api, booking_lost):
    """execution_params.max_cost_usd (transport/spend.py): a batch's estimate (prompt chars / 4 at
    $1 a token, max_new_tokens 100 at $2) is held before it goes and booked as spend while it is
    at the provider. Two chunks of 6 requests (~$1,220 each) under a $2,000 cap: the first is
    submitted, the second refused; the rerun with a raised cap re-attaches the first (not booked
    again), submits the second, and the spend is the results' usage at the price, by hand.
    ``booking_lost``: the first attempt was killed after the provider created the batch and
    before its booking was made and recorded: the re-attach books it, once."""
    api.trouble.hold.set()  # the first batch stays at the provider while the second is refused
    pricing = {"input_per_million": 1_000_000, "output_per_million": 2_000_000}
    raw = _config(tmp_path, api, "openai", max_requests_per_chunk=6, pricing=pricing, default_sampling_params={"max_new_tokens": 100})
    raw["execution_params"] = {"max_cost_usd": 2000}
    _rows(tmp_path / "in.jsonl", markers={})
    with pytest.raises(Exception, match=r"max_cost_usd.*this batch's estimate \$1.*cap \$2000\.0000.*raise execution_params\.max_cost_usd"):
        _run(raw)
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure["failure_class"] == "budget_exceeded"
    assert (api.batches_created, api.requests_seen) == (1, 6)
    ((first,),) = [[e for e in _ledger(tmp_path).values() if e["state"] == "submitted"]]
    spend = tmp_path / "state" / "spend.json"
    booked = json.loads(spend.read_text())
    assert booked["spent_usd"] == first["booked_usd"] == first["estimate_usd"] and 1200 < first["estimate_usd"] < 1500
    assert not booked.get("holds")
    if booking_lost:
        saved = json.loads((tmp_path / "state" / "shard_0" / "batches.json").read_text())
        for entry in saved["batches"].values():
            entry.pop("booked_usd", None)
        (tmp_path / "state" / "shard_0" / "batches.json").write_text(json.dumps(saved))
        spend.write_text(json.dumps({"spent_usd": 0.0}))

    api.trouble.hold.clear()
    raw["execution_params"]["max_cost_usd"] = 10_000
    status = _run(raw)
    assert status["engines"]["batch_api"]["details"]["batches_reattached"] == 1
    assert (api.batches_created, api.requests_seen) == (2, ROWS)  # no request asked twice
    assert len(_records(tmp_path)) == ROWS
    usage = [
        line["response"]["body"]["usage"]
        for b in api.batches.values()
        for line in map(json.loads, api.files[b["output_file_id"]].decode().splitlines())
    ]  # fmt: skip
    by_hand = sum(u["prompt_tokens"] * 1 + u["completion_tokens"] * 2 for u in usage)
    assert len(usage) == ROWS and 0 < by_hand < 1000
    assert json.loads(spend.read_text())["spent_usd"] == pytest.approx(by_hand, rel=1e-12)  # the first batch's estimate booked once
    assert sum(e["cost_usd"] for e in _ledger(tmp_path).values()) == pytest.approx(by_hand, rel=1e-12)
    assert status["stats"]["cost_usd"] == pytest.approx(by_hand, rel=1e-12)
