"""Issue 22, items 4 and 9: a template's render is bounded in time and size per row (its own
row error class, never a hang or a shard failure), and preflight refuses templates whose
cost it can see in their source."""

from __future__ import annotations

import json
import time

import pytest

from mirageflow.config import ConfigError, load_config
from mirageflow.prompts import render_bounds
from mirageflow.errors import RowError
from mirageflow.prompts.templates import Template, template_problems

NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def render_error(source: str, variables=None) -> RowError:
    with pytest.raises(RowError) as e:
        Template(source, "outputs.a.prompt").render(variables or {"text": "hello"})
    return e.value


def test_item4_nested_loops_are_refused_by_the_config_check(tmp_path):
    """Item 4: `mmirage check` accepted nested range(100000) loops that render for minutes."""
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    cfg = {
        "processors": [{"type": "llm", "server_args": {"model_path": "unused"}}],
        "loading_params": {"datasets": [{"path": str(tmp_path / "in.jsonl"), "type": "jsonl", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "text", "key": "text"}], "outputs": [{"name": "a", "prompt": NESTED + "{{ text }}"}]},
    }
    with pytest.raises(ConfigError, match=r"outputs\[0\]\.prompt: its loops run up to 10,000,000,000 iterations per row"):
        load_config(cfg)


def test_item4_a_render_past_its_deadline_is_its_rows_error(monkeypatch):
    """Item 4: a slow render is stopped at the deadline (template_timeout), whatever the loops."""
    monkeypatch.setattr(render_bounds, "RENDER_TIMEOUT_SECONDS", 0.5)
    started = time.monotonic()
    # loops over the row's data: preflight cannot see their cost
    e = render_error("{% for a in xs %}{% for b in xs %}{% for c in xs %}{% endfor %}{% endfor %}{% endfor %}", {"xs": list(range(3000))})
    assert time.monotonic() - started < 3
    assert (e.stage, e.kind) == ("render", "template_timeout")


@pytest.mark.parametrize(
    "source",
    [
        "{{ text * 200000000 }}",
        "{% for i in range(100000) %}{{ text * 1000 }}{% endfor %}",  # 500 M characters of output
        "{% set ns = namespace(x=text) %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}",
        "{% set x %}{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}{% endset %}{{ x|length }}",
        "{{ text.center(1000000000) }}",
        "{{ 10 ** 100000000 }}",
        "{{ '%999999999d' % 1 }}",
        "{{ text|replace('l', 'x' * 1000000) * 1 }}{% for i in range(100) %}{{ text|replace('l', 'x' * 1000000) }}{% endfor %}",
    ],
)
def test_item9_a_render_that_would_be_huge_is_its_rows_error(source):
    """Item 9: a template rendering 1 GB, or {{ text * 200000000 }}, ended the shard with
    EngineFailed: MemoryError; now the row fails as template_too_large, in well under a second."""
    started = time.monotonic()
    e = render_error(source)
    assert (e.stage, e.kind) == ("render", "template_too_large"), str(e)
    assert time.monotonic() - started < 4


def test_item9_record_templates_and_filter_predicates_are_bounded_too():
    """Items 4, 9: the record's output_schema and filter predicates render in the same bounds."""
    from mirageflow.shard.steps.python import FilterStep
    from mirageflow.prompts.templates import RecordRenderer

    render = RecordRenderer({"a": "{{ text * 200000000 }}"}, True, [])
    with pytest.raises(RowError) as e:
        render(0, {}, {"text": "hello"})
    assert e.value.kind == "template_too_large"
    out = type("O", (), {"name": "keep", "predicate": "(text * 200000000)|length > 1"})()
    with pytest.raises(RowError) as e:
        FilterStep(out).keep({"text": "hello"})
    assert (e.value.stage, e.value.kind) == ("filter", "template_too_large")


@pytest.mark.parametrize(
    "source, found",
    [
        ("{{ text * 200000000 }}", "repeats a value 200,000,000 times"),
        ("{{ text.center(1000000000) }}", "an argument of 1,000,000,000"),
        ("{{ 10 ** 100000000 }}", "is a number too large"),
        ("{{ '%999999999d' % 1 }}", "a format width of 999,999,999"),
    ],
)
def test_item9_preflight_refuses_what_it_can_see(source, found):
    """Items 4, 9: the config check names a template whose source shows a cost past the limits."""
    problems = template_problems(source, ["text"], "processing_params.outputs[0].prompt")
    assert any(found in p for p in problems), problems


def test_ordinary_templates_render_as_before():
    assert (
        Template("{% for i in range(3) %}{{ i }}{% endfor %} {{ text|upper }} {{ '%5d' % 7 }}", "p").render({"text": "hi"})
        == "012 HI     7"
    )
    assert template_problems("{% for x in items %}{% for y in x %}{{ y }}{% endfor %}{% endfor %}", ["items"], "p") == []


def test_item9_a_shard_with_a_huge_template_row_goes_on(tmp_path):
    """Item 9: through a shard: the huge row is a template_too_large row error, the others records."""
    from mirageflow.shard.runner import index_datasets, run_shard
    from fakes.engines import ScriptedEngine

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t, "n": n}) + "\n" for t, n in [("a", 1), ("b", 300000000), ("c", 2)]))
    cfg = load_config({
        "processors": [{"type": "llm", "server_args": {"model_path": "unused"}}],
        "loading_params": {"state_dir": str(tmp_path / "state"), "datasets": [{"path": str(tmp_path / "in.jsonl"), "type": "jsonl", "output_dir": str(tmp_path / "out")}]},
        "shard_params": {"max_error_rate": 0.5},
        "processing_params": {"inputs": [{"name": "text", "key": "text"}, {"name": "n", "key": "n"}],
                              "outputs": [{"name": "a", "prompt": "{{ text * n }}"}]},
    })  # fmt: skip
    index_datasets(cfg)
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda prompt: "ok"))
    assert status["stats"]["rows_failed_by_class"] == {"template_too_large": 1}
    assert status["stats"]["rows_processed"] == 2
