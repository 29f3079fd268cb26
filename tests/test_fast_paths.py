"""The per-row fast paths give exactly what the general code gives (no timing here).

- ``ChatTemplate`` (compiled chat template) vs ``tokenizer.apply_chat_template``;
- ``prompts.Template`` / record values (direct variable lookups, shared Jinja2 context) vs
  plain Jinja2 rendering in the same sandbox;
- ``Extractor``'s field-chain search vs JMESPath;
- ``json_output.FastValidator`` vs ``jsonschema.Draft7Validator``;
- incremental checkpoint ranges vs ``to_ranges`` of the whole set.
"""

from __future__ import annotations

import json
import random

import jinja2
import jmespath
import jsonschema
import pytest

from mirageflow.prompts import json_output
from mirageflow.prompts import templates as prompts
from mirageflow.shard.manifest import DatasetProgress, merge_ranges, to_ranges

# --------------------------------------------------------------------------- chat templates

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are helpful." %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
QWEN_LIKE = """{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
  {%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
  {%- if loop.index0 > 5 %}{%- break %}{%- endif %}
{%- endfor %}
{%- if tools %}{{ tools | tojson }}{%- endif %}
{%- for m in messages %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{%- endif %}
{% endif %}
{%- if strftime_now("%Y") | int > 2000 %}{{ {"last_user": ns.last_user, "names": ["é", "<b>&"], "pad": pad_token} | tojson }}{% endif %}
{{- custom_flag | default("no flag") }}"""

MESSAGES = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Summarise: a b c"}],
    [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "é <b> {{ x }}"}],
]
KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"custom_flag": "on", "bos_token": "<override>"}]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>", "hello"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # errors must match too: same class, same message
        return type(e).__name__, str(e)


@pytest.mark.parametrize(
    "template",
    [CHATML, LLAMA3, MISTRAL, QWEN_LIKE, {"default": LLAMA3, "tool_use": CHATML}],
    ids=["chatml", "llama3", "mistral", "qwen-like", "dict"],
)
def test_chat_template_renders_exactly_as_transformers(tokenizer, template):
    from mirageflow.engines.chat_template import ChatTemplate

    tokenizer.chat_template = template
    fast = ChatTemplate(tokenizer)
    assert fast._template is not None  # the fast path is taken
    for messages in MESSAGES:
        for kwargs in KWARGS:
            want = _outcome(lambda: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs))
            assert _outcome(lambda: fast(messages, kwargs)) == want, (messages, kwargs)


def test_chat_template_falls_back_for_apply_chat_template_parameters(tokenizer):
    from mirageflow.engines.chat_template import ChatTemplate

    tokenizer.chat_template = QWEN_LIKE
    fast = ChatTemplate(tokenizer)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = MESSAGES[0]
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
    assert fast(messages, {"tools": tools}) == want and '"name": "f"' in want
    assert _outcome(lambda: fast([], {})) == _outcome(lambda: tokenizer.apply_chat_template([], tokenize=False, add_generation_prompt=True))


def test_engine_default_chat_prompt_uses_the_tokenizer(tokenizer):
    from mirageflow.engines.base import Engine

    class E(Engine):
        def load(self):
            pass

        async def generate_one(self, request):
            raise NotImplementedError

    e = E()
    e.tokenizer = tokenizer
    tokenizer.chat_template = CHATML
    assert e.chat_prompt(MESSAGES[1], {}) == tokenizer.apply_chat_template(MESSAGES[1], tokenize=False, add_generation_prompt=True)
    with pytest.raises(NotImplementedError):
        E().chat_prompt(MESSAGES[0], {})


# --------------------------------------------------------------------------- prompt and record templates

_PLAIN = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)

TEMPLATES = [
    "Summarise: {{ text }}",
    "{{ a }}{{ b }} and {{ a }}\n",
    "constant text only\n",
    "",
    "{{ qa.question }} / {{ qa.answer }}",
    "{{ qa.items }}",  # a dict method, not a key: Jinja2 decides
    "{{ qa._private }}",
    "{{ deep.x.y }}",
    "{{ missing }}",
    "{{ range }}",  # a Jinja2 global
    "{{ text | upper }} {{ n + 1 }}",
    "{%- if n > 1 %}big{% endif %} {{- text -}} ",
]
VARIABLES = [
    {
        "text": "hello",
        "a": 1,
        "b": None,
        "qa": {"question": "Q?", "answer": True, "items": "key", "_private": 5},
        "deep": {"x": {"y": 2.5}},
        "n": 3,
    },
    {"text": "é <b>", "a": [1, 2], "b": {"k": "v"}, "qa": {"question": 0}, "deep": {"x": 7}, "n": 0, "range": "shadowed"},
    {"text": "", "a": False, "b": "", "qa": "not a dict", "deep": None, "n": 2},
]


def _jinja(source, variables):
    return _PLAIN.from_string(source).render(variables)


@pytest.mark.parametrize("source", TEMPLATES)
def test_prompt_templates_render_as_jinja2(source):
    t = prompts.Template(source, "where")
    for variables in VARIABLES:
        want = _outcome(lambda: _jinja(source, variables))
        got = _outcome(lambda: t.render(variables))
        if want[0] == "ok":
            assert got == want, (source, variables)
        else:
            assert got[0] == "RowError" and want[1] in got[1], (source, variables, got, want)


@pytest.mark.parametrize(
    "expr", ["{{ qa }}", "{{ qa.question }}", "{{ qa.items }}", "{{ deep.x.y }}", " {{ n }} ", "{{ missing }}", "{{ n * 2 }}"]
)
def test_lone_expressions_keep_their_type(expr):
    evaluate = prompts._compile_value(expr, "where")
    compiled = _PLAIN.compile_expression(prompts._LONE_EXPR.match(expr).group(1), undefined_to_none=False)
    for variables in VARIABLES:
        want = _outcome(lambda: compiled(variables))
        got = _outcome(lambda: evaluate(variables))
        if want[0] == "ok" and not isinstance(want[1], jinja2.Undefined):
            assert got == want and type(got[1]) is type(want[1]), (expr, variables)
        else:
            assert got[0] == "RowError", (expr, variables, got)


def test_fast_renderer_matches_template_render():
    t = _PLAIN.from_string("{% for x in items %}{{ loop.index }}:{{ x }} {% endfor %}{{ range(2) | list }}")
    assert prompts.fast_renderer(t)({"items": "ab"}) == t.render(items="ab")


# --------------------------------------------------------------------------- extraction


def _random_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice(["", "x", "é"])
    if kind == 2:
        return rng.choice([0, 1, 2.5, True, False])
    if kind == 3:
        return []
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {k: _random_value(rng, depth + 1) for k in rng.sample(["a", "b", "my key", "get"], rng.randrange(4))}


@pytest.mark.parametrize("key", ["a", "a.b", "a.b.a", '"my key"', 'a."my key".b', "get", "a.get"])
def test_field_chains_search_as_jmespath(key):
    expr = jmespath.compile(key)
    path = prompts._field_path(expr.parsed)
    assert path is not None
    fast = prompts._FieldSearch(path)
    rng = random.Random(key)
    for _ in range(2000):
        row = _random_value(rng)
        if not isinstance(row, dict):
            row = {"a": row}
        assert fast.search(row) == expr.search(row), (key, row)


def test_other_jmespath_expressions_are_not_field_chains():
    for key in ["a[0]", "a[*].b", "a || b", "length(a)", "a.b[0]", "`1`"]:
        assert prompts._field_path(jmespath.compile(key).parsed) is None


# --------------------------------------------------------------------------- JSON validation

SCHEMAS = [
    ["question", "answer"],
    {"n": "int", "x": {"type": "float", "min": -1.5, "max": 2}, "ok": "bool", "s": "str"},
    {"k": {"type": "int", "min": 0, "max": 9}},
    [],
]
VALUES = [
    {},
    {"question": "q", "answer": "a"},
    {"question": 1, "answer": "a"},
    {"question": "q"},
    {"question": "q", "answer": "a", "extra": [1]},
    {"n": 1, "x": 0.5, "ok": True, "s": ""},
    {"n": 1.0, "x": 2, "ok": False, "s": "x"},
    {"n": 1.5, "x": 0, "ok": True, "s": "x"},
    {"n": True, "x": 0, "ok": True, "s": "x"},
    {"n": 1, "x": True, "ok": True, "s": "x"},
    {"n": 1, "x": -2, "ok": True, "s": "x"},
    {"n": 1, "x": 2.0001, "ok": 1, "s": "x"},
    {"n": 1, "x": float("nan"), "ok": True, "s": "x"},
    {"n": float("inf"), "x": 1, "ok": True, "s": None},
    {"k": 0},
    {"k": 9},
    {"k": 10},
    {"k": -1},
    {"k": 9.0},
    {"k": "3"},
    {"k": None},
]


@pytest.mark.parametrize("spec", SCHEMAS, ids=str)
def test_fast_validator_agrees_with_jsonschema(spec):
    schema = json_output.OutputSchema.parse(spec, "s")
    fast = schema.validator()
    slow = jsonschema.Draft7Validator(schema.json_schema())
    for value in VALUES:
        messages = lambda v: sorted(e.message for e in v.iter_errors(value))  # noqa: E731
        assert messages(fast) == messages(slow), value
        assert fast.is_valid(value) == slow.is_valid(value), value
        text = json.dumps(value)
        assert _outcome(lambda: json_output.parse_answer(text, fast, False)) == _outcome(
            lambda: json_output.parse_answer(text, slow, False)
        )


# --------------------------------------------------------------------------- checkpoint ranges


def test_incremental_ranges_equal_ranges_of_the_whole_set(tmp_path):
    rng = random.Random(0)
    prog = DatasetProgress(tmp_path, "parquet")
    for _ in range(300):
        batch = [rng.randrange(2000) for _ in range(rng.randrange(1, 40))]
        prog.add("done", batch)
        assert prog.ranges("done") == to_ranges(prog.done)
    prog.done = {1, 2, 5}  # replaced from outside: recomputed
    assert prog.ranges("done") == [[1, 3], [5, 6]]
    prog.done.add(3)  # changed from outside: recomputed
    assert prog.ranges("done") == [[1, 4], [5, 6]]
    assert merge_ranges([[0, 2], [5, 7]], [[2, 3], [6, 9], [20, 21]]) == [[0, 3], [5, 9], [20, 21]]


# --------------------------------------------------------------------------- JSON response prefixes

PREFIX_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}, "ok": {"type": "boolean"},
                   "rank": {"type": "integer", "minimum": 1}},
    "required": ["answer", "score", "ok", "rank"],
}  # fmt: skip
PREFIXES = [
    "{", '{"', '{"ans', '{"answer"', '{"answer": ', '{"answer": "', '{"answer": "a, b', '{"answer": "x"',
    '{"answer": "x", ', '{"answer": "x", "score": -', '{"answer": "x", "score": 12', '{"answer": "x", "score": 12, "ok": t',
    '{"answer": "x", "score": 0, "ok": false, "rank": ', '{"answer": "x", "score": 0, "ok": false, "rank": 3}',
    '{"score": ', '{"answer": 5', '{"answer":"x"', '{ "answer": ', '{"answer": "x", "score": 012', '{"answer": "a\\n',
    '{"answer": "x", "score": 1, "ok": true, "rank": 2, ', "[", '{"answer": "x"}', '{"answer": "x", "score": 1.5',
]  # fmt: skip


@pytest.mark.parametrize("prefix", PREFIXES)
def test_json_prefix_fast_check_vouches_only_for_what_the_grammar_takes(prefix):
    """``certainly_starts`` (the preflight's check without xgrammar) says True only for a
    prefix xgrammar's grammar continues; the usual prefixes it takes without xgrammar."""
    pytest.importorskip("xgrammar")
    from mirageflow.engines.json_prefix import certainly_starts, continuation_grammar

    certain = certainly_starts(PREFIX_SCHEMA, prefix)
    try:
        continuation_grammar(json.dumps(PREFIX_SCHEMA), prefix)
        grammar_takes = True
    except ValueError:
        grammar_takes = False
    assert grammar_takes or not certain
    if prefix in ("{", '{"answer": ', '{"answer": "', '{"answer": "x", "score": 12'):
        assert certain
