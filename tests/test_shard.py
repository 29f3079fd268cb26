"""The shard runner with a scripted engine: per-row errors, JSON validation, status and stats."""

from __future__ import annotations

import json

import pytest

from mirageflow.config import load_config
from mirageflow.data.readers import build_index
from mirageflow.data.writers import atomic_write_json, read_parts
from mirageflow.engines.base import Completion, Engine, EngineInfo
from mirageflow.shard import ShardFailed, index_path, run_shard


class ScriptedEngine(Engine):
    """Answers each prompt with ``answer(prompt)``; records what it was asked."""

    def __init__(self, answer):
        self.answer = answer
        self.prompts: list[str] = []
        self.closed = False
        self.info = EngineInfo(backend="scripted", model_path="none")

    def load(self):
        pass

    def chat_prompt(self, messages, kwargs):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def generate(self, requests):
        for r in requests:
            self.prompts.append(r.prompt)
            result = self.answer(r.prompt)
            if isinstance(result, Completion):
                result.id = r.id
                yield result
            else:
                yield Completion(r.id, result, len(r.prompt), len(result.split()), "stop")

    def close(self):
        self.closed = True


def _setup(tmp_path, rows, outputs, output_schema=None, num_shards=1):
    data = tmp_path / "in.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    cfg = load_config({
        "processors": [{"type": "llm", "server_args": {"model_path": "unused"}}],
        "loading_params": {
            "state_dir": str(tmp_path / "state"),
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out")}],
            "num_shards": num_shards,
        },
        "processing_params": {
            "inputs": [{"name": "q", "key": "q"}],
            "outputs": outputs,
            "remove_columns": True,
            "output_schema": output_schema or {"q": "{{ q }}", "a": "{{ a }}"},
        },
    })  # fmt: skip
    for ds in cfg.datasets:
        atomic_write_json(index_path(cfg.state_dir, ds.index), build_index(ds, cfg.num_shards))
    return cfg


def _errors(cfg, shard=0):
    return [json.loads(line) for line in (cfg.shard_dir(shard) / "errors.jsonl").read_text().splitlines()]


JSON_OUTPUT = {"name": "a", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": {"n": {"type": "int", "min": 0, "max": 9}}}


def test_json_outputs_are_validated_and_bad_ones_become_row_errors(tmp_path):
    answers = {"ok": '{"n": 3}', "fenced": '```json\n{"n": 4}\n```', "big": '{"n": 12}', "word": "three", "cut": '{"n": '}
    cfg = _setup(tmp_path, [{"q": q} for q in answers], [JSON_OUTPUT])

    def answer(prompt):
        key = prompt.split(":", 1)[1]
        if key == "cut":
            return Completion(0, answers[key], 5, 7, "length")
        return answers[key]

    status = run_shard(cfg, 0, engine_factory=lambda p, b: ScriptedEngine(answer))
    records = read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist()
    assert records == [{"q": "ok", "a": {"n": 3}, "source_index": 0}, {"q": "fenced", "a": {"n": 4}, "source_index": 1}]
    errors = {e["source_index"]: e for e in _errors(cfg)}
    assert errors[2]["error"] == "json_schema" and "12 is greater than the maximum of 9" in errors[2]["message"]
    assert errors[3]["error"] == "json_parse" and errors[3]["raw"] == "three"
    assert errors[4]["error"] == "json_truncated"
    st = status["stats"]
    assert (st["rows_processed"], st["rows_failed"]) == (2, 3)
    assert st["rows_failed_by_class"] == {"json_schema": 1, "json_parse": 1, "json_truncated": 1}
    assert st["output_tokens"] == 2 + 4 + 2 + 1 + 7  # whitespace words; the cut answer reports 7 and st["requests"] == 5


def test_later_outputs_see_earlier_ones_and_system_prompts(tmp_path):
    outputs = [
        {"name": "a", "prompt": "first {{ q }}", "system": "be brief"},
        {"name": "b", "prompt": "second {{ a }}"},
    ]
    cfg = _setup(tmp_path, [{"q": "x"}], outputs, {"b": "{{ b }}"})
    engine = ScriptedEngine(lambda p: p.rsplit(":", 1)[1].upper())
    run_shard(cfg, 0, engine_factory=lambda p, b: engine)
    assert engine.prompts == ["system:be brief|user:first x", "user:second FIRST X"]
    assert read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist() == [{"b": "SECOND FIRST X", "source_index": 0}]
    assert engine.closed


def test_generation_errors_are_row_errors(tmp_path):
    cfg = _setup(tmp_path, [{"q": "long"}, {"q": "fine"}], [{"name": "a", "prompt": "{{ q }}"}])

    def answer(prompt):
        if "long" in prompt:
            return Completion(0, "", 900, 0, "abort", "context_length", "prompt has 900 tokens")
        return "ok"

    status = run_shard(cfg, 0, engine_factory=lambda p, b: ScriptedEngine(answer))
    assert [e["error"] for e in _errors(cfg)] == ["context_length"]
    assert status["stats"]["rows_processed"] == 1


def test_a_shard_where_every_row_fails_fails_loudly(tmp_path):
    cfg = _setup(tmp_path, [{"q": "a"}, {"other": 1}, "[1, 2]"], [JSON_OUTPUT])
    engine = ScriptedEngine(lambda p: "not json")
    with pytest.raises(ShardFailed, match=r"every row of shard 0 failed \(.*json_parse: 1"):
        run_shard(cfg, 0, engine_factory=lambda p, b: engine)
    assert engine.closed
    assert not (cfg.shard_dir(0) / "status.json").exists()
    failure = json.loads((cfg.shard_dir(0) / "failure.json").read_text())
    assert failure["status"] == "failed" and "every row" in failure["error"]
    assert sorted(e["error"] for e in _errors(cfg)) == ["bad_row", "json_parse", "missing_variable"]


def test_empty_shard_succeeds_with_zero_rows(tmp_path):
    cfg = _setup(tmp_path, [{"q": "only"}], [{"name": "a", "prompt": "{{ q }}"}], num_shards=2)
    status = run_shard(cfg, 1, engine_factory=lambda p, b: ScriptedEngine(lambda p: "x"))
    assert status["stats"]["rows_processed"] == 0 and status["datasets"][0]["row_range"] == [1, 1]
