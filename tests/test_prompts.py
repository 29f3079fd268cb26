"""Rows -> variables -> prompts -> records: extraction, chat messages, record rendering, sandbox."""

from __future__ import annotations

import pytest

from mirageflow.config import InputVar, OutputVar
from mirageflow.errors import RowError
from mirageflow.prompts.templates import Extractor, PromptBuilder, RecordRenderer, Template

_NO_DEFAULT = object()


def var(name: str, key: str, default=_NO_DEFAULT) -> InputVar:
    return InputVar(name, key, default is not _NO_DEFAULT, None if default is _NO_DEFAULT else default)


def output(prompt: str, system: str | None = None, name: str = "out") -> OutputVar:
    return OutputVar(name, "llm", prompt, system, "", False, None, {})


def row_error(fn, *args) -> RowError:
    with pytest.raises(RowError) as err:
        fn(*args)
    return err.value


def render(shape, variables: dict, row: dict | None = None, remove_columns: bool = True, source_index: int = 0):
    return RecordRenderer(shape, remove_columns, list(variables))(source_index, row or {}, variables)


ROW = {
    "id": 7,
    "meta": {"topic": "math", "tags": ["a", "b", "c"], "score": 0, "empty": "", "flag": False, "none": None},
    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
}


# --------------------------------------------------------------------------- Extractor


def test_extract_nested_jmespath():
    extract = Extractor(
        [
            var("topic", "meta.topic"),
            var("last_tag", "meta.tags[-1]"),
            var("first", "messages[0].content"),
            var("roles", "messages[*].role"),
            var("meta", "meta"),
        ]
    )
    values = extract(ROW)
    assert values["topic"] == "math"
    assert values["last_tag"] == "c"
    assert values["first"] == "hi"
    assert values["roles"] == ["user", "assistant"]
    assert values["meta"] == ROW["meta"]


def test_missing_key_is_a_row_error():
    err = row_error(Extractor([var("id", "id"), var("title", "meta.title")]), ROW)
    assert (err.stage, err.kind) == ("extract", "missing_variable")
    assert "title" in str(err) and "meta.title" in str(err)


def test_default_used_for_missing_key_and_null():
    extract = Extractor([var("title", "meta.title", "untitled"), var("none", "meta.none", "n/a")])
    assert extract(ROW) == {"title": "untitled", "none": "n/a"}


def test_null_without_default_is_missing():
    assert row_error(Extractor([var("none", "meta.none")]), ROW).kind == "missing_variable"


def test_falsy_values_are_not_replaced_by_default():
    extract = Extractor([var("score", "meta.score", 99), var("empty", "meta.empty", "x"), var("flag", "meta.flag", True)])
    assert extract(ROW) == {"score": 0, "empty": "", "flag": False}


def test_default_may_be_null():
    assert Extractor([var("title", "title", None)])({}) == {"title": None}


@pytest.mark.parametrize("row", [["a", "b"], "text", 3, None])
def test_non_dict_row_is_bad_row(row):
    err = row_error(Extractor([var("id", "id", 0)]), row)
    assert (err.stage, err.kind) == ("extract", "bad_row")


# --------------------------------------------------------------------------- PromptBuilder


def test_system_and_user_messages():
    builder = PromptBuilder(output("Summarise: {{ text }}", system="You are {{ persona }}."))
    assert builder.messages({"text": "abc", "persona": "terse"}) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Summarise: abc"},
    ]


def test_user_message_only_without_system():
    assert PromptBuilder(output("Q: {{ q }}")).messages({"q": "why?"}) == [{"role": "user", "content": "Q: why?"}]


def test_prompt_keeps_text_verbatim_without_escaping():
    msgs = PromptBuilder(output("{{ code }}\n")).messages({"code": "<b>&'\"</b>"})
    assert msgs[-1]["content"] == "<b>&'\"</b>"


def test_prompt_may_use_structured_variables():
    builder = PromptBuilder(output("{% for m in msgs %}{{ m.role }}: {{ m.content }}\n{% endfor %}"))
    assert builder.messages({"msgs": ROW["messages"]})[0]["content"] == "user: hi\nassistant: hello\n"


def test_strict_undefined_attribute_is_render_error():
    builder = PromptBuilder(output("About {{ doc.headline }}", name="summary"))
    for doc in ({"title": "t"}, "a plain string"):
        err = row_error(builder.messages, {"doc": doc})
        assert (err.stage, err.kind) == ("render", "template_error")
        assert "outputs.summary.prompt" in str(err)
        assert "headline" in str(err)


def test_strict_undefined_in_system_is_render_error():
    builder = PromptBuilder(output("ok", system="{{ missing }}", name="s"))
    err = row_error(builder.messages, {})
    assert err.stage == "render"
    assert "outputs.s.system" in str(err)


# --------------------------------------------------------------------------- RecordRenderer


def test_lone_expression_keeps_types():
    variables = {"d": {"k": [1, 2]}, "xs": [1, "two"], "n": 3, "f": 0.5, "b": False, "none": None}
    shape = {k: "{{ " + k + " }}" for k in variables}
    record = render(shape, variables)
    assert record == {**variables, "source_index": 0}
    assert isinstance(record["n"], int) and isinstance(record["b"], bool)


def test_lone_expression_tolerates_whitespace():
    assert render({"n": "  {{n}}\n"}, {"n": 5})["n"] == 5


def test_lone_expression_attribute_path_and_filters():
    variables = {"quiz": {"question": "Q?", "answer": "A", "options": ["x", "y"]}}
    record = render({"q": "{{ quiz.question }}", "first": "{{ quiz.options[0] }}", "n": "{{ quiz.options | length }}"}, variables)
    assert record == {"q": "Q?", "first": "x", "n": 2, "source_index": 0}


def test_mixed_text_template_gives_str():
    record = render({"s": "n={{ n }}", "two": "{{ a }}{{ b }}", "joined": "{{ a }} and {{ b }}"}, {"n": 3, "a": 1, "b": 2})
    assert record["s"] == "n=3"
    assert record["two"] == "12"
    assert record["joined"] == "1 and 2"


def test_nested_lists_and_mappings():
    shape = {
        "conversations": [
            {"role": "user", "content": "{{ q }}"},
            {"role": "assistant", "content": "{{ a }}"},
        ],
        "meta": {"len": "{{ a | length }}", "const": 1, "tags": ["fixed", "{{ q }}"]},
    }
    record = render(shape, {"q": "2+2?", "a": "four"})
    assert record == {
        "conversations": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}],
        "meta": {"len": 4, "const": 1, "tags": ["fixed", "2+2?"]},
        "source_index": 0,
    }


def test_remove_columns_true_keeps_only_schema_fields():
    record = render({"q": "{{ q }}"}, {"q": "x"}, row={"q_raw": "x", "other": 1}, remove_columns=True, source_index=12)
    assert record == {"q": "x", "source_index": 12}


def test_remove_columns_false_keeps_row_and_overrides_same_name():
    row = {"id": 1, "text": "old"}
    record = render({"text": "{{ new }}"}, {"new": "fresh"}, row=row, remove_columns=False, source_index=3)
    assert record == {"id": 1, "text": "fresh", "source_index": 3}
    assert row == {"id": 1, "text": "old"}  # the row itself is not changed


def test_source_index_overrides_a_row_column():
    record = render({}, {"o": 1}, row={"source_index": "stale"}, remove_columns=False, source_index=5)
    assert record["source_index"] == 5


def test_empty_output_schema_gives_row_plus_outputs():
    renderer = RecordRenderer({}, False, ["summary", "quiz"])
    variables = {"text": "input var", "summary": "s", "quiz": {"q": 1}}
    record = renderer(4, {"id": 9, "text": "t"}, variables)
    assert record == {"id": 9, "text": "t", "summary": "s", "quiz": {"q": 1}, "source_index": 4}


def test_empty_output_schema_with_remove_columns_gives_outputs_only():
    renderer = RecordRenderer({}, True, ["summary"])
    assert renderer(0, {"id": 9}, {"text": "x", "summary": "s"}) == {"summary": "s", "source_index": 0}


def test_undefined_in_record_is_render_error():
    err = row_error(render, {"a": {"b": "{{ nope }}"}}, {})
    assert (err.stage, err.kind) == ("render", "template_error")
    assert "processing_params.output_schema.a.b" in str(err)


def test_undefined_in_mixed_record_template_is_render_error():
    err = row_error(render, {"a": ["x {{ nope }}"]}, {})
    assert err.stage == "render"
    assert "processing_params.output_schema.a[0]" in str(err)


# --------------------------------------------------------------------------- sandbox


UNSAFE = "{{ ''.__class__.__mro__ }}"


def test_sandbox_blocks_dunder_access_in_template():
    err = row_error(Template(f"x {UNSAFE}", "outputs.o.prompt").render, {})
    assert (err.stage, err.kind) == ("render", "template_error")


def test_sandbox_blocks_dunder_access_in_prompt():
    assert row_error(PromptBuilder(output(UNSAFE)).messages, {}).stage == "render"


@pytest.mark.parametrize("expr", [UNSAFE, "{{ ''.__class__ }}", "{{ f.__globals__ }}"])
def test_sandbox_blocks_dunder_access_in_lone_record_expression(expr):
    err = row_error(render, {"a": expr}, {"f": test_sandbox_blocks_dunder_access_in_template})
    assert err.stage == "render"


def test_sandbox_is_immutable():
    xs = [1]
    err = row_error(render, {"a": "{{ xs.append(2) }}"}, {"xs": xs})
    assert err.stage == "render"
    assert xs == [1]
    with pytest.raises(RowError):
        Template("x{{ xs.append(2) }}", "w").render({"xs": xs})
    assert xs == [1]
