"""JSON outputs: the three output_schema forms, their JSON Schema, and parsing model answers."""

from __future__ import annotations

import pytest

from mirageflow.prompts.json_output import Field, OutputError, OutputSchema, SchemaError, parse_answer

WHERE = "outputs[0].output_schema"


def schema_of(spec) -> OutputSchema:
    return OutputSchema.parse(spec, WHERE)


def parse(text: str, spec=None, truncated: bool = False) -> dict:
    spec = {"answer": "str", "score": {"type": "int", "min": 1, "max": 5}} if spec is None else spec
    return parse_answer(text, schema_of(spec).validator(), truncated)


def output_error(text: str, spec=None, truncated: bool = False) -> OutputError:
    with pytest.raises(OutputError) as err:
        parse(text, spec, truncated)
    return err.value


# --------------------------------------------------------------------------- OutputSchema.parse


def test_list_form_gives_string_fields():
    assert schema_of(["question", "answer"]).fields == (Field("question", "string"), Field("answer", "string"))


def test_mapping_of_types_normalises_type_names():
    s = schema_of({"a": "str", "b": "string", "c": "int", "d": "integer", "e": "float", "f": "number", "g": "bool", "h": "Boolean"})
    assert [f.type for f in s.fields] == ["string", "string", "integer", "integer", "number", "number", "boolean", "boolean"]


def test_mapping_with_bounds():
    s = schema_of({"score": {"type": "int", "min": 0, "max": 10}, "p": {"type": "number", "max": 0.5}})
    assert s.fields == (Field("score", "integer", 0, 10), Field("p", "number", None, 0.5))


def test_mixed_forms():
    s = schema_of({"text": "str", "n": {"type": "integer", "min": "2"}, "ok": {"type": "bool"}})
    assert s.fields == (Field("text", "string"), Field("n", "integer", 2, None), Field("ok", "boolean"))


def test_numeric_string_bounds_become_numbers():
    [f] = schema_of({"n": {"type": "int", "min": "-3", "max": "1e2"}}).fields
    assert (f.minimum, f.maximum) == (-3, 100)
    assert isinstance(f.minimum, int) and isinstance(f.maximum, int)


def test_integral_float_bound_is_allowed_on_int():
    [f] = schema_of({"n": {"type": "int", "max": 4.0}}).fields
    assert f.maximum == 4


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"a": "decimal"}, f"{WHERE}.a.type: unknown type 'decimal'"),
        ({"a": None}, f"{WHERE}.a.type: missing type"),
        ({"a": {"type": "str", "max": 3}}, f"{WHERE}.a: min/max are only allowed on numeric fields"),
        ({"a": {"type": "int", "min": "x"}}, f"{WHERE}.a.min: bound must be a number"),
        ({"a": {"type": "int", "min": [1]}}, f"{WHERE}.a.min: bound must be a number"),
        ({"a": {"type": "float", "min": "nan"}}, f"{WHERE}.a.min: bound must be a number"),
        ({"a": {"type": "int", "min": 0.5}}, f"{WHERE}.a.min: fractional bound"),
        ({"a": {"type": "float", "min": 2, "max": 1.5}}, f"{WHERE}.a: min 2 is greater than max 1.5"),
        ({"a": {"type": "int", "default": 1}}, f"{WHERE}.a.default: unknown key"),
        ("a, b", f"{WHERE}: expected a list of field names or a mapping"),
        ([1], f"{WHERE}[0]: field names must be non-empty strings"),
    ],
)
def test_bad_specs(spec, expected):
    with pytest.raises(SchemaError) as err:
        schema_of(spec)
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith(expected)


def test_every_problem_is_reported():
    with pytest.raises(SchemaError) as err:
        schema_of({"a": "decimal", "b": {"type": "int", "min": 3, "max": 1}, "c": "str"})
    assert len(err.value.problems) == 2


def test_equal_bounds_are_allowed():
    assert schema_of({"a": {"type": "int", "min": 3, "max": 3}}).fields[0] == Field("a", "integer", 3, 3)


# --------------------------------------------------------------------------- json_schema


def test_json_schema_content():
    s = schema_of({"answer": "str", "score": {"type": "int", "min": 1, "max": 5}, "p": {"type": "float", "min": 0}})
    assert s.json_schema() == {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
            "p": {"type": "number", "minimum": 0},
        },
        "required": ["answer", "score", "p"],
    }


def test_empty_schema_is_any_object():
    assert schema_of([]).json_schema() == {"type": "object", "properties": {}, "required": []}
    assert parse_answer('{"anything": [1]}', schema_of([]).validator(), False) == {"anything": [1]}


# --------------------------------------------------------------------------- parse_answer


def test_plain_json():
    assert parse('{"answer": "Paris", "score": 5}') == {"answer": "Paris", "score": 5}


def test_extra_fields_are_kept():
    assert parse('{"answer": "x", "score": 1, "note": "extra"}')["note"] == "extra"


@pytest.mark.parametrize("fence", ["```json", "```", "  ```json  "])
def test_fenced_block(fence):
    text = f'{fence}\n{{"answer": "Paris", "score": 4}}\n```\n'
    assert parse(text) == {"answer": "Paris", "score": 4}


def test_text_around_one_object():
    text = 'Sure! Here it is: {"answer": "a {b} c", "score": 2} Hope this helps.'
    assert parse(text) == {"answer": "a {b} c", "score": 2}


def test_fence_after_prose():
    text = 'Answer:\n```json\n{"answer": "x", "score": 3}\n```'
    assert parse(text) == {"answer": "x", "score": 3}


@pytest.mark.parametrize("text", ["Paris", "", "{answer: Paris}", '{"a": 1} and {"b": 2}'])
def test_not_json(text):
    err = output_error(text)
    assert err.kind == "json_parse"


def test_unparsable_and_truncated():
    err = output_error('{"answer": "Paris is the capital of', truncated=True)
    assert err.kind == "json_truncated"
    assert "max_new_tokens" in str(err)


def test_truncated_flag_does_not_hide_a_complete_answer():
    assert parse('{"answer": "x", "score": 5}', truncated=True) == {"answer": "x", "score": 5}


def test_truncated_but_parsable_yet_invalid_is_schema_error():
    assert output_error('{"answer": "x"}', truncated=True).kind == "json_schema"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"answer": 3, "score": 2}', "answer"),
        ('{"answer": "x", "score": "2"}', "score"),
        ('{"answer": "x", "score": 6}', "score"),
        ('{"answer": "x", "score": 0}', "score"),
        ('{"answer": "x", "score": 2.5}', "score"),
        ('{"answer": "x"}', "'score' is a required property"),
    ],
)
def test_schema_violations(text, fragment):
    err = output_error(text)
    assert err.kind == "json_schema"
    assert fragment in str(err)


def test_bounds_are_inclusive():
    assert parse('{"answer": "x", "score": 1}')["score"] == 1
    assert parse('{"answer": "x", "score": 5}')["score"] == 5


@pytest.mark.parametrize("text", ['["answer", "score"]', "42", '"text"', "null"])
def test_json_that_is_not_an_object(text):
    assert output_error(text).kind == "json_schema"


def test_bool_is_not_an_integer():
    err = output_error('{"answer": "x", "score": true}')
    assert err.kind == "json_schema"
    assert parse('{"ok": true}', {"ok": "bool"}) == {"ok": True}
    assert output_error('{"ok": 1}', {"ok": "bool"}).kind == "json_schema"


def test_number_accepts_int_and_float():
    spec = {"p": {"type": "float", "min": 0, "max": 1}}
    assert parse('{"p": 1}', spec) == {"p": 1}
    assert parse('{"p": 0.25}', spec) == {"p": 0.25}
    assert output_error('{"p": 1.5}', spec).kind == "json_schema"
