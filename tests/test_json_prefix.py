"""The grammar of a response prefix's continuation (engines/json_prefix.py), checked with
the real xgrammar: what completes the prefix to valid JSON is accepted, nothing else."""

from __future__ import annotations

import json

import pytest

from mirageflow.engines.json_prefix import continuation_grammar, derivative_ebnf

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"answer": {"type": "string"}, "score": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "kind": {"enum": ["a", 'b"c']}},
    "required": ["answer", "score", "kind"], "additionalProperties": False,
})  # fmt: skip
FULL = '{"answer": "y\\u00e9s \\"q\\"", "score": -12, "tags": ["x", "y"], "kind": "b\\"c"}'


def accepts(grammar: str, text: str) -> bool:
    import xgrammar

    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(grammar)
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_the_full_answer_is_valid_json_of_the_schema():
    assert json.loads(FULL)["kind"] == 'b"c' and accepts(continuation_grammar(SCHEMA, ""), FULL)


@pytest.mark.parametrize("cut", [1, 2, 11, 12, 16, 20, 36, 37, 60, len(FULL) - 1, len(FULL)])
def test_the_rest_of_the_answer_completes_any_prefix_of_it(cut):
    """Cut anywhere (inside a key, a string, an escape, a number, the array): the grammar
    of the continuation accepts exactly the rest, not the whole object again."""
    prefix, rest = FULL[:cut], FULL[cut:]
    grammar = continuation_grammar(SCHEMA, prefix)
    assert grammar.startswith("root ::= ")
    assert accepts(grammar, rest), (prefix, grammar)
    if cut:
        assert not accepts(grammar, FULL)
    if rest:
        assert not accepts(grammar, rest[:-1])  # an unfinished object is not an answer


def test_a_prefix_no_valid_answer_starts_with_is_refused():
    for prefix in ('{"score": ', "[", '{"answer": 1', '{"answer": "x"}'):
        with pytest.raises(ValueError, match="does not start any JSON value valid against"):
            continuation_grammar(SCHEMA, prefix)


def test_a_pretty_printed_prefix_gets_the_free_whitespace_grammar():
    grammar = continuation_grammar(SCHEMA, '{\n  "answer": ')
    assert accepts(grammar, '"a",\n  "score": 1,\n  "kind": "a"\n}')


def test_recursive_and_left_recursive_rules():
    nested = json.dumps({"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}}})
    grammar = continuation_grammar(nested, '{"child": {"child": {')
    assert accepts(grammar, '"v": 1}}}') and accepts(grammar, "}}}") and not accepts(grammar, "}}")
    left = 'root ::= root "a" | "b"\n'  # b a*, through a left-recursive rule
    assert accepts(derivative_ebnf(left, "ba"), "aa") and accepts(derivative_ebnf(left, "ba"), "")
    assert derivative_ebnf(left, "a") is None
