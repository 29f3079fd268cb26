"""A successful shard is proof: every row of its range is a record or a recorded row error,
odd rows stay row-level, empty answers are errors, and stats add up over attempts."""

from __future__ import annotations

import json

import pytest
from fakes.configs import shard_config
from fakes.engines import ScriptedEngine
from fakes.runs import row_errors

from mirageflow.data import readers
from mirageflow.data.writers import read_parts
from mirageflow.engines.wire import Completion
from mirageflow.prompts.templates import RecordRenderer
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import run_shard

PLAIN = [{"name": "a", "prompt": "{{ q }}"}]


def _engine(answer=lambda p: "ans"):
    return lambda p, b, **kw: ScriptedEngine(answer)


def test_a_reader_that_raises_mid_shard_fails_it_naming_the_dataset(tmp_path, monkeypatch):
    """Before: the exception ended the workers, a gather swallowed it, and the shard 'succeeded'
    with the rest of its rows missing."""
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(10)], PLAIN)
    real = readers.read_shard

    def broken(ds, piece, skip=lambda i: False, columns=None):
        for row in real(ds, piece, skip, columns=columns):
            if row.index == 4:
                raise OSError("corrupt row group 1 of in.parquet")
            yield row

    monkeypatch.setattr("mirageflow.shard.feed.read_shard", broken)
    with pytest.raises(ShardFailed, match=r"cannot read dataset 0 \(.*in.jsonl\).*corrupt row group"):
        run_shard(cfg, 0, engine_factory=_engine())
    assert not (cfg.shard_dir(0) / "status.json").exists()
    failure = json.loads((cfg.shard_dir(0) / "failure.json").read_text())
    assert "corrupt row group" in failure["error"]


def test_a_reader_that_silently_drops_rows_fails_the_accounting(tmp_path, monkeypatch):
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(10)], PLAIN)
    real = readers.read_shard

    def dropping(ds, piece, skip, columns=None):
        return (r for r in real(ds, piece, skip, columns=columns) if r.index not in (3, 4, 7))

    monkeypatch.setattr("mirageflow.shard.feed.read_shard", dropping)
    with pytest.raises(
        ShardFailed,
        match=r"should be 10 records \+ row errors \+ filtered rows, found 7 \+ 0 \+ 0; rows neither written nor recorded: \[\[3, 5\], \[7, 8\]\]",
    ):
        run_shard(cfg, 0, engine_factory=_engine())
    assert not (cfg.shard_dir(0) / "status.json").exists()


def test_odd_rows_are_row_errors_naming_the_row_and_the_rest_succeed(tmp_path):
    rows = [{"q": "fine", "t": "abc"}, {"q": "num", "t": 7}, {"q": "ok", "t": "de"}]
    cfg = shard_config(tmp_path, rows, PLAIN)
    raw = json.loads(json.dumps(cfg.raw))
    raw["processing_params"]["inputs"].append({"name": "n", "key": "length(t)"})
    raw["processing_params"]["outputs"][0]["prompt"] = "{{ q }} {{ n }}"
    from mirageflow.config import load_config

    cfg = load_config(raw)
    status = run_shard(cfg, 0, engine_factory=_engine())
    [error] = row_errors(cfg)
    assert (error["source_index"], error["error"], error["stage"]) == (1, "extract_error", "extract")
    assert "length(t)" in error["message"]
    assert status["stats"]["rows_processed"] == 2


def test_an_unexpected_exception_on_the_row_path_is_that_rows_error(tmp_path, monkeypatch):
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(4)], PLAIN)
    real = RecordRenderer.__call__

    def render(self, index, row, variables):
        if index == 2:
            raise TypeError("unhashable type: 'dict'")
        return real(self, index, row, variables)

    monkeypatch.setattr(RecordRenderer, "__call__", render)
    status = run_shard(cfg, 0, engine_factory=_engine())
    [error] = row_errors(cfg)
    assert (error["source_index"], error["error"]) == (2, "internal_error")
    assert "TypeError: unhashable type" in error["message"]
    assert status["stats"]["rows_processed"] == 3


def test_empty_answers_are_an_error_class_unless_allowed(tmp_path):
    answers = {"a": "text", "b": "", "c": "  \n", "d": "more"}
    cfg = shard_config(tmp_path, [{"q": q} for q in answers], PLAIN)
    status = run_shard(cfg, 0, engine_factory=_engine(lambda p: answers[p.rsplit(":", 1)[1]]))
    assert sorted((e["source_index"], e["error"]) for e in row_errors(cfg)) == [(1, "empty_output"), (2, "empty_output")]
    assert status["stats"]["rows_failed_by_class"] == {"empty_output": 2}

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    cfg = shard_config(allowed, [{"q": q} for q in answers], [{**PLAIN[0], "allow_empty_output": True}])
    run_shard(cfg, 0, engine_factory=_engine(lambda p: answers[p.rsplit(":", 1)[1]]))
    assert [r["a"] for r in read_parts(allowed / "out" / "shard_0", "parquet").to_pylist()] == ["text", "", "  \n", "more"]


def test_a_lone_surrogate_in_an_answer_is_a_row_error(tmp_path):
    json_out = [{"name": "a", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": ["s"]}]
    answers = {"good": '{"s": "fine"}', "escaped": '{"s": "bad \\ud800 here"}'}
    cfg = shard_config(tmp_path, [{"q": q} for q in answers], json_out)
    status = run_shard(cfg, 0, engine_factory=_engine(lambda p: answers[p.rsplit(":", 1)[1]]))
    [error] = row_errors(cfg)
    assert (error["source_index"], error["error"]) == (1, "invalid_unicode")
    assert status["stats"]["rows_processed"] == 1


def test_an_engine_that_raises_fails_the_shard(tmp_path):
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(3)], PLAIN)

    def answer(prompt):
        raise RuntimeError("CUDA error: device-side assert")

    with pytest.raises(Exception, match="engine 'llm' failed on row .*CUDA error"):
        run_shard(cfg, 0, engine_factory=_engine(answer))
    assert not (cfg.shard_dir(0) / "status.json").exists()


def test_stats_add_up_over_attempts(tmp_path):
    """Before: a resumed shard's status counted only its last attempt (0 output tokens, tok/s n/a)."""
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(8)], PLAIN)
    raw = json.loads(json.dumps(cfg.raw))
    raw["shard_params"].update(max_errors=2, max_error_rate=1.0)
    from mirageflow.config import load_config

    cfg = load_config(raw)
    # attempt 1: rows r5.. fail, the budget stops the shard after committing what finished
    failing = lambda p: "" if int(p.rsplit("r", 1)[1]) >= 5 else "one two"  # noqa: E731
    with pytest.raises(ShardFailed, match="error budget"):
        run_shard(cfg, 0, engine_factory=_engine(failing))
    first = json.loads((cfg.shard_dir(0) / "failure.json").read_text())["stats"]
    assert len(first["attempts"]) == 1 and first["attempts"][0]["outcome"] == "failed"
    assert first["output_tokens"] > 0

    raw["retry_failed_rows"] = True
    cfg = load_config(raw)
    status = run_shard(cfg, 0, attempt=1, engine_factory=_engine(lambda p: "three four five"))
    st = status["stats"]
    assert [a["outcome"] for a in st["attempts"]] == ["failed", "success"]
    assert st["output_tokens"] == sum(a["output_tokens"] for a in st["attempts"]) > st["attempts"][1]["output_tokens"]
    assert st["requests"] == sum(a["requests"] for a in st["attempts"])
    assert st["rows_computed"] == sum(a["rows_computed"] for a in st["attempts"])
    assert st["rows_processed"] + st["rows_failed"] == 8
    assert st["tokens_per_sec"] is not None
    assert st["output_tokens_per_row_hist"]["rows"] == st["rows_processed"]  # the records, once each


def test_secrets_in_an_engine_error_are_not_written_to_failure_json(tmp_path):
    cfg = shard_config(tmp_path, [{"q": "r0"}], PLAIN)

    def answer(prompt):
        raise ConnectionError("cannot reach http://user:hunter2@node:30000/v1 (--api-key=sk-secret)")

    with pytest.raises(ShardFailed):
        run_shard(cfg, 0, engine_factory=_engine(answer))
    text = (cfg.shard_dir(0) / "failure.json").read_text() + (cfg.shard_dir(0) / "checkpoint.json").read_text()
    assert "hunter2" not in text and "sk-secret" not in text and "user:***@node" in text


THINK_JSON = {"name": "a", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": {"n": {"type": "int", "min": 0, "max": 9}}}


def _thinking(answers: dict):
    """Answers keyed by the row's q; a (text, finish_reason, reasoning) tuple for details."""

    def answer(prompt):
        got = answers[prompt.split(":", 1)[1]]
        if isinstance(got, tuple):
            text, finish, reasoning = got
            return Completion(0, text, 5, 9, finish, reasoning=reasoning)
        return got

    return lambda p, b, **kw: ScriptedEngine(answer)


def test_reasoning_is_never_the_answer_and_a_cut_while_thinking_is_its_own_class(tmp_path):
    answers = {
        "think": '<think>\nmaybe {"n": 7}? no: 3\n</think>\n\n{"n": 3}',
        "plain": '{"n": 4}',
        "server": ('{"n": 5}', "stop", 'thinking about {"n": 8}'),
        "cut": ('<think>\nlet me think about {"n": 1', "length", None),
        "server_cut": ("", "length", "still thinking"),
        "only": "<think>hmm</think>\n",
    }
    cfg = shard_config(tmp_path, [{"q": q} for q in answers], [THINK_JSON])
    status = run_shard(cfg, 0, engine_factory=_thinking(answers))
    records = read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist()
    assert [(r["q"], r["a"]) for r in records] == [("think", {"n": 3}), ("plain", {"n": 4}), ("server", {"n": 5})]
    errors = {e["source_index"]: e["error"] for e in row_errors(cfg)}
    assert errors == {3: "reasoning_truncated", 4: "reasoning_truncated", 5: "empty_output"}
    assert status["stats"]["rows_failed_by_class"] == {"reasoning_truncated": 2, "empty_output": 1}


def test_keep_reasoning_sets_the_reasoning_variable(tmp_path):
    answers = {
        "think": "<think>\n because \n</think>\nyes",
        "server": ("no", "stop", "a server's reasoning"),
        "plain": "maybe",
    }
    outputs = [{"name": "a", "prompt": "{{ q }}", "keep_reasoning": True}]
    cfg = shard_config(tmp_path, [{"q": q} for q in answers], outputs, {"q": "{{ q }}", "a": "{{ a }}", "why": "{{ a_reasoning }}"})
    run_shard(cfg, 0, engine_factory=_thinking(answers))
    records = sorted(
        read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist(), key=lambda r: r["source_index"]
    )  # parts: in completion order
    assert [(r["a"], r["why"]) for r in records] == [("yes", "because"), ("no", "a server's reasoning"), ("maybe", None)]


def test_the_reasoning_variable_exists_only_with_keep_reasoning(tmp_path):
    from mirageflow.config import ConfigError

    with pytest.raises(ConfigError, match="unknown variable 'a_reasoning'"):
        shard_config(tmp_path, [{"q": "x"}], PLAIN, {"a": "{{ a }}", "why": "{{ a_reasoning }}"})
