"""A server's reasoning parser through the ``openai`` backend and the shard: vLLM answers
``message.reasoning``, SGLang (and vLLM before 0.10) ``message.reasoning_content``; both are
the row's ``<name>_reasoning`` with ``keep_reasoning``, never the answer, and an answer cut
while the model was still thinking is the row error ``reasoning_truncated``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes.fake_http import Behaviour, FakeServer

from mirageflow.config import load_config
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard


def _run(tmp_path: Path, server: FakeServer, max_tokens: int = 64) -> tuple[list[dict], list[dict], dict]:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(4)))
    cfg = load_config({
        "processors": [{"type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "m"},
                        "default_sampling_params": {"max_new_tokens": max_tokens}}],
        "loading_params": {
            "state_dir": str(tmp_path / "state"),
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out"), "output_format": "jsonl"}],
        },
        "shard_params": {"max_error_rate": 1.0},
        "processing_params": {
            "inputs": [{"name": "q", "key": "q"}],
            "outputs": [{"name": "a", "type": "llm", "prompt": "{{ q }}", "keep_reasoning": True}],
            "remove_columns": True,
            "output_schema": {"a": "{{ a }}", "why": "{{ a_reasoning }}"},
        },
    }, check_paths=False)  # fmt: skip
    index_datasets(cfg)
    try:
        status = run_shard(cfg, 0)
    except ShardFailed:  # every row failed: the errors are still written
        status = json.loads((cfg.shard_dir(0) / "failure.json").read_text())
    records = [json.loads(line) for p in sorted((tmp_path / "out" / "shard_0").glob("part-*")) for line in p.read_text().splitlines()]
    errors_path = cfg.shard_dir(0) / "errors.jsonl"
    errors = [json.loads(line) for line in errors_path.read_text().splitlines()] if errors_path.exists() else []
    return records, errors, status


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_the_reasoning_of_either_field_is_kept_apart_from_the_answer(tmp_path, field):
    server = FakeServer(Behaviour(reasoning="let me think", reasoning_field=field)).start()
    try:
        records, errors, _ = _run(tmp_path, server)
    finally:
        server.stop()
    assert errors == [] and len(records) == 4
    assert all(r["why"] == "let me think" and r["a"].startswith("w0") and "think" not in r["a"] for r in records)


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_answer_cut_while_thinking_is_reasoning_truncated(tmp_path, field):
    """vLLM's reasoning parser with the length limit reached inside the thinking: the
    reasoning and no content, finish_reason length."""
    server = FakeServer(Behaviour(reasoning="still thinking about", reasoning_field=field, reasoning_only=True)).start()
    try:
        records, errors, status = _run(tmp_path, server, max_tokens=1)
    finally:
        server.stop()
    assert records == [] and [e["error"] for e in errors] == ["reasoning_truncated"] * 4
    assert all(
        e["message"].startswith("output 'a': the length limit (max_new_tokens) cut the answer while the model was still reasoning")
        for e in errors
    )
    assert status["stats"]["rows_failed_by_class"] == {"reasoning_truncated": 4}
