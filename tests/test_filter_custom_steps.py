"""Filter steps and Python (custom) steps: each step kind, hostile predicates and functions,
the accounting (ok + failed + filtered = rows), resume, and one run through `snakemake`."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from conftest import run_workflow
from fakes.configs import pipeline_config
from fakes.engines import EngineCrash, ScriptedEngine
from fakes.fake_http import FakeServer

from mirageflow.config import ConfigError, load_config
from mirageflow.data.writers import read_parts
from mirageflow.config.preflight import preflight_problems
from mirageflow.errors import RowError
from mirageflow.config.types import CustomProcessor
from mirageflow.shard.steps.python import FilterStep, FunctionPool
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard

pytestmark = pytest.mark.usefixtures("no_proxy")

SCRIPT = """
import math, os, signal, time

def label(v):
    q = v["q"]
    if q == "raise":
        raise ValueError("no label for " + q)
    if q == "sleep":
        time.sleep(30)
    if q == "crash":
        os._exit(9)
    if q == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    if q == "set":
        return {1, 2}
    if q == "nan":
        return math.nan
    score = v.get("score")
    return {"len": len(q), "upper": q.upper(), "double": None if score is None else 2 * score["n"]}
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "steps.py"
    path.write_text(SCRIPT)
    return path


# --------------------------------------------------------------------------- filter step


def _filter(predicate: str, name: str = "keep") -> FilterStep:
    cfg = load_config({
        "processors": [{"type": "llm", "server_args": {"model_path": "unused"}}],
        "loading_params": {"datasets": [{"path": "in.jsonl", "type": "JSONL", "output_dir": "out"}]},
        "processing_params": {
            "inputs": [{"name": "q", "key": "q"}, {"name": "score", "key": "score"}],
            "outputs": [{"name": name, "type": "filter", "predicate": predicate}],
        },
    }, check_paths=False)  # fmt: skip
    return FilterStep(cfg.outputs[0])


def test_a_filter_keeps_true_rows_and_drops_false_ones():
    step = _filter("score > 33")
    assert step.keep({"q": "a", "score": 34}) is True
    assert step.keep({"q": "a", "score": 33}) is False
    assert _filter("{{ q == 'yes' }}").keep({"q": "yes", "score": 0}) is True  # braces are accepted too


@pytest.mark.parametrize(
    "predicate, variables, kind, message",
    [
        ("score > 33", {"q": "a", "score": "forty"}, "filter_error", "predicate 'score > 33' raised TypeError"),
        ("score.n > 1", {"q": "a", "score": {"m": 1}}, "filter_error", "raised UndefinedError"),
        ("q", {"q": "false", "score": 1}, "filter_not_bool", "gave str 'false', not true or false"),
        ("score", {"q": "a", "score": 1}, "filter_not_bool", "gave int 1"),
        ("score and q", {"q": "a", "score": None}, "filter_not_bool", "gave NoneType None"),
    ],
)
def test_a_predicate_that_raises_or_is_not_a_boolean_is_a_row_error(predicate, variables, kind, message):
    with pytest.raises(RowError) as e:
        _filter(predicate).keep(variables)
    assert (e.value.stage, e.value.kind) == ("filter", kind) and message in str(e.value) and "filter 'keep'" in str(e.value)


# --------------------------------------------------------------------------- custom step: the pool


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    script = _script(tmp_path_factory.mktemp("script"))
    p = FunctionPool(CustomProcessor("custom", str(script), "label", max_workers=2, timeout_ms=1500))
    p.start()
    yield p
    p.close()


def _call(pool, q):
    return asyncio.run(pool.call({"q": q}, "output 'lab'"))


def test_the_function_gets_the_variables_and_its_value_comes_back(pool):
    assert _call(pool, "abc") == {"len": 3, "upper": "ABC", "double": None}


@pytest.mark.parametrize(
    "q, kind, message",
    [
        ("raise", "custom_error", "output 'lab': ValueError: no label for raise"),
        ("set", "custom_bad_value", "returned a value that is not JSON (set"),
        ("nan", "custom_bad_value", "returned a value that is not JSON (float"),
        ("crash", "custom_crashed", "the worker process died (exit code 9)"),
        ("sleep", "custom_timeout", "ran past timeout_ms (1500 ms)"),
    ],
)
def test_hostile_functions_are_row_errors_with_their_class_and_the_pool_goes_on(pool, q, kind, message):
    with pytest.raises(RowError) as e:
        _call(pool, q)
    assert (e.value.stage, e.value.kind) == ("custom", kind) and message in str(e.value)
    assert _call(pool, "next") == {"len": 4, "upper": "NEXT", "double": None}  # a replaced worker serves the next row


def test_a_worker_that_sigterms_itself_fails_its_row_and_a_cancelled_shard_stops(pool, monkeypatch):
    # issue 22, item 6: the function's own SIGTERM is its row's error (retried once, then custom_crashed)
    with pytest.raises(RowError) as e:
        _call(pool, "term")
    assert e.value.kind == "custom_crashed" and "killed by SIGTERM" in str(e.value)
    # scancel signals every process of the job: when the shard got the signal too, the row is
    # not at fault and the shard stops (a rerun redoes the row)
    monkeypatch.setattr(pool, "stopping", lambda: True)
    with pytest.raises(ShardFailed, match="output 'lab': a worker process of processor 'custom' was stopped by signal SIGTERM"):
        _call(pool, "term")
    monkeypatch.undo()
    assert _call(pool, "after") == {"len": 5, "upper": "AFTER", "double": None}


def test_a_crash_inside_a_batch_fails_only_its_row(pool, monkeypatch):
    sizes = []
    outcomes = FunctionPool._outcomes

    async def counted(self, worker, rows):
        sizes.append(len(rows))
        return await outcomes(self, worker, rows)

    monkeypatch.setattr(FunctionPool, "_outcomes", counted)
    qs = [f"r{i}" for i in range(7)] + ["crash"] + [f"s{i}" for i in range(4)]

    async def scenario():
        return await asyncio.gather(*(pool.call({"q": q}, "output 'lab'") for q in qs), return_exceptions=True)

    results = asyncio.run(scenario())
    assert max(sizes) > 1  # rows that waited went together
    for q, r in zip(qs, results):
        if q == "crash":
            assert isinstance(r, RowError) and r.kind == "custom_crashed"
        else:
            assert r == {"len": len(q), "upper": q.upper(), "double": None}


def test_code_that_ignores_the_alarm_is_stopped_by_killing_its_worker(tmp_path, monkeypatch):
    monkeypatch.setattr("mirageflow.shard.steps.python.BACKSTOP_SLACK", 0.5)
    (tmp_path / "stuck.py").write_text(
        "import signal, time\n"
        "def f(v):\n"
        "    if v['q'] == 'stuck':\n"
        "        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as C code that never returns to Python\n"
        "        time.sleep(30)\n"
        "    return v['q']\n"
    )
    p = FunctionPool(CustomProcessor("custom", str(tmp_path / "stuck.py"), "f", start_method="fork", timeout_ms=200))
    p.start()
    try:
        with pytest.raises(RowError, match="ran past timeout_ms \\(200 ms\\) and ignored the alarm: its worker was killed") as e:
            asyncio.run(p.call({"q": "stuck"}, "output 'x'"))
        assert e.value.kind == "custom_timeout"
        assert asyncio.run(p.call({"q": "fine"}, "output 'x'")) == "fine"
    finally:
        p.close()


def test_the_event_loop_runs_on_while_the_function_works(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ndef slow(v):\n    time.sleep(0.6)\n    return 1\n")
    p = FunctionPool(CustomProcessor("custom", str(tmp_path / "slow.py"), "slow", start_method="fork"))
    p.start()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def scenario():
        t = asyncio.create_task(ticker())
        value = await p.call({}, "output 'x'")
        t.cancel()
        return value

    try:
        assert asyncio.run(scenario()) == 1
    finally:
        p.close()
    assert ticks >= 20  # ~60 at 10 ms; a blocked loop would tick once or twice


def test_a_script_that_does_not_load_fails_the_pool_at_start(tmp_path):
    (tmp_path / "bad.py").write_text("import not_a_module_anywhere\n")
    p = FunctionPool(CustomProcessor("custom", str(tmp_path / "bad.py"), "f", start_method="fork"))
    with pytest.raises(RuntimeError, match="cannot load 'f' from .*bad.py': ModuleNotFoundError"):
        p.start()
    p.close()


# --------------------------------------------------------------------------- config checks at DAG build


def _pipeline(tmp_path: Path, outputs: list, script: Path | None = None, function: str = "label") -> dict:
    data = tmp_path / "in.jsonl"
    if not data.exists():
        data.write_text(json.dumps({"q": "x"}) + "\n")
    cfg = pipeline_config(
        data, outputs=outputs, state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=None,
        processing={"remove_columns": True, "output_schema": {"q": "{{ q }}"}},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
    )  # fmt: skip
    if script is not None:
        cfg["processors"].append({"type": "custom", "script_path": str(script), "function_name": function, "max_workers": 2})
    return cfg


SCORE = {"name": "score", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": {"n": "int"}}


@pytest.mark.parametrize(
    "outputs, with_script, problem",
    [
        (
            [SCORE, {"name": "f", "type": "filter", "predicate": "scroe.n > 33"}],
            False,
            "processing_params.outputs[1].predicate: unknown variable 'scroe' (did you mean 'score'?)",
        ),
        (
            [SCORE, {"name": "f", "type": "filter", "predicate": "score.m > 33"}],
            False,
            "processing_params.outputs[1].predicate: 'score.m': output 'score' has no field 'm'",
        ),
        (
            [{"name": "f", "type": "filter", "predicate": "lab > 1"}, {"name": "lab", "type": "custom"}],
            True,
            "processing_params.outputs[0].predicate: unknown variable 'lab'",
        ),  # a later output is not known yet
        ([{"name": "f", "type": "filter"}], False, "processing_params.outputs[0].predicate: required key is missing"),
        ([{"name": "f", "type": "filter", "predicate": "q > (1"}], False, "processing_params.outputs[0].predicate: template syntax error"),
        (
            [{"name": "f", "type": "filter", "predicate": "q", "prompt": "{{ q }}"}],
            False,
            "processing_params.outputs[0].prompt: only LLM outputs have a prompt (this output's type is filter)",
        ),
        ([{"name": "lab", "type": "custom"}], False, "processing_params.outputs[0].type: no 'custom' processor is defined"),
        (
            [{"name": "a", "prompt": "{{ q }}", "predicate": "q"}],
            False,
            "processing_params.outputs[0].predicate: only outputs of type filter have a predicate",
        ),
    ],
)
def test_config_mistakes_in_steps_are_named_by_key(tmp_path, outputs, with_script, problem):
    script = _script(tmp_path) if with_script else None
    with pytest.raises(ConfigError) as e:
        load_config(_pipeline(tmp_path, outputs, script))
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_a_missing_script_or_function_is_refused_at_dag_build(tmp_path):
    outputs = [{"name": "lab", "type": "custom"}]
    with pytest.raises(ConfigError, match=r"processors\[1\]\.script_path: Python file '.*nope\.py' does not exist"):
        load_config(_pipeline(tmp_path, outputs, tmp_path / "nope.py"))

    def custom_problems(pipeline):  # the preflight of the driver (the llm's model dir 'unused' is refused too)
        return [p for p in preflight_problems(load_config(pipeline)) if p.startswith("processors[1]")]

    (found,) = custom_problems(_pipeline(tmp_path, outputs, _script(tmp_path), function="lable"))
    assert re.fullmatch(r"processors\[1\]\.function_name: '.*steps\.py' defines no 'lable' \(callables found: label\)", found)
    (tmp_path / "broken.py").write_text("def label(v:\n")
    (found,) = custom_problems(_pipeline(tmp_path, outputs, tmp_path / "broken.py"))
    assert re.match(r"processors\[1\]\.script_path: cannot import '.*broken\.py': SyntaxError", found)
    good = _pipeline(tmp_path, outputs, _script(tmp_path))
    assert custom_problems(good) == []
    cfg = load_config(good)  # custom processors are kept apart from the engines
    assert list(cfg.processors) == ["llm"] and cfg.custom_processors["custom"].max_workers == 2


def test_an_edited_script_changes_the_records_identity(tmp_path):
    from mirageflow.config import records_identity

    script = _script(tmp_path)
    cfg = _pipeline(tmp_path, [{"name": "lab", "type": "custom"}], script)
    before = records_identity(load_config(cfg))
    script.write_text(SCRIPT + "\n# changed\n")
    assert records_identity(load_config(cfg)) != before
    plain = load_config(_pipeline(tmp_path, [{"name": "a", "prompt": "{{ q }}"}]))
    assert "scripts" not in records_identity(plain)  # configs without custom steps: identity as before


# --------------------------------------------------------------------------- the shard


ROWS = ["a", "bb", "raise", "ccc", "dddd", "ee", "f", "gggggg"]  # score = 10 * len: 10..60; "raise" fails


def _shard_config(tmp_path: Path) -> dict:
    cfg = _pipeline(tmp_path, [
        SCORE,
        {"name": "keep", "type": "filter", "predicate": "score.n > 25"},
        {"name": "lab", "type": "custom"},
        {"name": "echo", "prompt": "{{ lab.upper }}"},
    ], _script(tmp_path))  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"q": q}) + "\n" for q in ROWS))
    cfg["processing_params"]["output_schema"] = {"q": "{{ q }}", "n": "{{ score.n }}", "lab": "{{ lab }}", "echo": "{{ echo }}"}
    return cfg


def _answer(prompt: str) -> str:
    q = prompt.rsplit(":", 1)[1]
    return f'{{"n": {10 * len(q)}}}' if q == q.lower() else f"echo {q}"


def test_filtered_rows_are_counted_not_written_and_the_accounting_adds_up(tmp_path):
    cfg = load_config(_shard_config(tmp_path))
    index_datasets(cfg)
    engine = ScriptedEngine(_answer)
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: engine)
    st = status["stats"]
    # score > 25: "a", "bb", "ee", "f" (10, 20, 20, 10) dropped; "raise" (50) fails in the custom step
    assert (st["rows_processed"], st["rows_failed"], st["rows_filtered"]) == (3, 1, 4)
    assert st["rows_processed"] + st["rows_failed"] + st["rows_filtered"] == len(ROWS)
    assert st["rows_failed_by_class"] == {"custom_error": 1}
    ds = status["datasets"][0]
    assert (ds["rows_processed"], ds["rows_failed"], ds["rows_filtered"]) == (3, 1, 4)
    records = sorted(read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist(), key=lambda r: r["source_index"])
    assert [r["q"] for r in records] == ["ccc", "dddd", "gggggg"]
    assert records[0]["lab"] == {"len": 3, "upper": "CCC", "double": 60} and records[0]["echo"] == "echo CCC"
    error = json.loads((cfg.shard_dir(0) / "errors.jsonl").read_text())
    assert (error["source_index"], error["stage"], error["error"]) == (2, "custom", "custom_error")
    assert "ValueError: no label for raise" in error["message"]
    # filtered rows stopped at the filter: the later LLM output was never asked for them
    assert sorted(p.rsplit(":", 1)[1] for p in engine.prompts if p.rsplit(":", 1)[1].isupper()) == ["CCC", "DDDD", "GGGGGG"]
    manifest = json.loads((cfg.shard_dir(0) / "checkpoint.json").read_text())
    assert manifest["datasets"]["0"]["filtered"] == [[0, 2], [5, 7]]


def test_a_rerun_after_a_crash_keeps_filtered_rows_filtered(tmp_path):
    cfg = load_config(_shard_config(tmp_path))
    index_datasets(cfg)
    calls = {"n": 0}

    def crashing(prompt):
        calls["n"] += 1
        if calls["n"] > 9:
            raise EngineCrash("engine died")
        return _answer(prompt)

    with pytest.raises(ShardFailed, match="EngineCrash"):
        run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(crashing))
    before = json.loads((cfg.shard_dir(0) / "checkpoint.json").read_text())["datasets"]["0"]
    filtered_before = {i for a, b in before["filtered"] for i in range(a, b)}
    assert filtered_before  # the first rows (0, 1 filtered) were committed before the crash

    engine = ScriptedEngine(_answer)
    status = run_shard(cfg, 0, attempt=2, engine_factory=lambda p, b, **kw: engine)
    asked = {ROWS.index(p.rsplit(":", 1)[1]) for p in engine.prompts if p.rsplit(":", 1)[1].islower()}
    assert not asked & filtered_before  # no redo of a filtered row
    st = status["stats"]
    assert (st["rows_processed"], st["rows_failed"], st["rows_filtered"]) == (3, 1, 4)
    assert st["rows_resumed"] >= len(filtered_before)


def test_a_shard_of_only_filtered_rows_succeeds_with_no_records(tmp_path):
    cfg = _pipeline(tmp_path, [SCORE, {"name": "keep", "type": "filter", "predicate": "score.n > 1000"}])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"q": q}) + "\n" for q in ["a", "b", "c"]))
    cfg = load_config(cfg)
    index_datasets(cfg)
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(_answer))
    assert (status["stats"]["rows_processed"], status["stats"]["rows_filtered"]) == (0, 3)


# --------------------------------------------------------------------------- through snakemake


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def test_llm_json_score_filter_and_custom_step_through_snakemake(tmp_path, server):
    """The fake server answers every JSON request {"answer": "yes"}; the custom step scores
    each row from its title and that answer, and the filter keeps scores above 33."""
    (tmp_path / "score.py").write_text(
        "def score(v):\n"
        "    if v['title'] == 'boom':\n"
        "        raise RuntimeError('cannot score boom')\n"
        "    return 10 * len(v['title']) + (1 if v['review']['answer'] == 'yes' else 0)\n"
    )
    titles = ["ab", "abcd", "boom", "abcdefgh", "a", "abcdef"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"title": t}) + "\n" for t in titles))
    pipeline = {
        "processors": [
            {"type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "fake-model"},
             "default_sampling_params": {"max_new_tokens": 8}, "max_retries": 0, "request_timeout": 30},
            {"type": "custom", "script_path": "score.py", "function_name": "score", "max_workers": 2, "timeout_ms": 20000},
        ],
        "loading_params": {"state_dir": "state", "num_shards": 2,
                           "datasets": [{"path": "in.jsonl", "type": "jsonl", "output_dir": "out", "output_format": "jsonl"}]},
        "shard_params": {"max_error_rate": 0.5},
        "processing_params": {
            "inputs": [{"name": "title", "key": "title"}],
            "outputs": [
                {"name": "review", "prompt": "Review {{ title }}", "output_type": "JSON", "output_schema": ["answer"]},
                {"name": "s", "type": "custom"},
                {"name": "high", "type": "filter", "predicate": "s > 33 and review.answer == 'yes'"},
            ],
            "remove_columns": True,
            "output_schema": {"title": "{{ title }}", "s": "{{ s }}"},
        },
    }  # fmt: skip
    run_workflow(tmp_path, pipeline)
    merged = [json.loads(line) for f in sorted((tmp_path / "out" / "merged").glob("part-*.jsonl")) for line in f.read_text().splitlines()]
    assert [(r["title"], r["s"]) for r in merged] == [("abcd", 41), ("abcdefgh", 81), ("abcdef", 61)]
    metrics = json.loads((tmp_path / "state" / "metrics.json").read_text())
    agg = metrics["aggregate"]
    assert (agg["total_rows_processed"], agg["total_rows_failed"], agg["total_rows_filtered"]) == (3, 1, 2)
    assert agg["rows_failed_by_class"] == {"custom_error": 1}
    assert "rows filtered" in (tmp_path / "state" / "summary.md").read_text()
    statuses = [json.loads((tmp_path / f"state/shard_{i}/status.json").read_text()) for i in range(2)]
    assert sum(s["stats"]["rows_filtered"] for s in statuses) == 2
    error = json.loads((tmp_path / "state/shard_0/errors.jsonl").read_text())
    assert error["error"] == "custom_error" and "RuntimeError: cannot score boom" in error["message"]


def test_a_pipeline_of_python_steps_only_needs_no_engine(tmp_path):
    cfg = _pipeline(
        tmp_path, [{"name": "lab", "type": "custom"}, {"name": "keep", "type": "filter", "predicate": "lab.len > 1"}], _script(tmp_path)
    )
    cfg["processors"] = cfg["processors"][1:]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"q": q}) + "\n" for q in ["a", "bb", "ccc"]))
    cfg["processing_params"]["output_schema"] = {"q": "{{ q }}", "n": "{{ lab.len }}"}
    cfg = load_config(cfg)
    index_datasets(cfg)

    def no_engine(*args, **kwargs):
        raise AssertionError("no LLM output: no engine is loaded")

    status = run_shard(cfg, 0, engine_factory=no_engine)
    assert (status["stats"]["rows_processed"], status["stats"]["rows_filtered"]) == (2, 1) and status["engines"] == {}
    records = sorted(read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist(), key=lambda r: r["source_index"])
    assert [(r["q"], r["n"]) for r in records] == [("bb", 2), ("ccc", 3)]
