"""Rows -> variables -> prompts -> records: JMESPath extraction, Jinja2 templates, chat messages.

Everything is compiled once per config; per row only evaluation happens. Templates run
in Jinja2's sandbox with StrictUndefined, so a missing attribute is a row error, not an
empty string.

Per row cost matters (the runner must keep a GPU fed at tens of thousands of rows/s), so
the common shapes take fast paths with the same results as Jinja2/JMESPath:

- a template made only of text and ``{{ name }}`` / ``{{ name.key.key }}`` is joined
  directly from the variables (``str()`` of each value, as Jinja2 does); anything else, and
  any lookup that is not a plain dict key, renders through Jinja2;
- Jinja2 renders get a context built from one dict with the globals merged in once (what
  ``Template.render`` rebuilds from a ChainMap on every call);
- a JMESPath key that is a field or a chain of fields (``a.b.c``) is evaluated as JMESPath's
  own interpreter does (``.get`` per field, ``None`` when missing or not an object).
"""

from __future__ import annotations

import json

import collections.abc as _abc
import difflib
import re
from typing import Any, Callable, Iterable, Mapping

import jinja2
import jmespath
import jmespath.exceptions
from jinja2 import meta, nodes
from jinja2.runtime import new_context as _new_context

from mirageflow.config.types import OutputVar
from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.prompts.render_bounds import BoundedSandbox, RenderTimeout, RenderTooLarge, cost_problems, guarded, limit_message

# Jinja2's immutable sandbox, with a render's size limits (mirageflow.prompts.render_bounds)
_ENV = BoundedSandbox(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)
_LONE_EXPR = re.compile(r"^\s*\{\{(.*?)\}\}\s*$", re.S)


# --------------------------------------------------------------------------- validation helpers


def compile_jmespath(expr: str):
    try:
        return jmespath.compile(expr)
    except jmespath.exceptions.ParseError as e:
        raise ValueError(f"invalid JMESPath expression {expr!r}: {e}") from None


_LOADERS = (nodes.Include, nodes.Extends, nodes.Import, nodes.FromImport)
_TAG = {nodes.Include: "include", nodes.Extends: "extends", nodes.Import: "import", nodes.FromImport: "from ... import"}


def template_variables(source: str) -> set[str]:
    """The variables a template names (raises jinja2.TemplateSyntaxError when it does not parse)."""
    return meta.find_undeclared_variables(_ENV.parse(source))


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    found = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{found[0]}'?)" if found else ""


def sandbox_problems(ast, where: str) -> list[str]:
    """What the sandbox refuses or cannot do, found in the parsed template instead of on every row.

    Templates are self-contained strings: there is no loader, so ``{% include %}``,
    ``{% extends %}`` and ``{% import %}`` cannot work; filters and tests must be Jinja2's
    built-in ones; dunder attributes (``__class__``, ``x['__globals__']``, ``x|attr('__init__')``)
    are blocked by the sandbox (an escape attempt, or a failure on every row). A key that
    merely starts with one ``_`` (``row._id``) is an ordinary dict key and stays allowed.
    """
    problems = []
    for node in ast.find_all(_LOADERS):
        problems.append(
            f"{where}: {{% {_TAG[type(node)]} %}} is not available: templates are self-contained strings (no template files are loaded)"
        )
    for node in ast.find_all(nodes.Filter):
        if node.name not in _ENV.filters:
            problems.append(f"{where}: unknown filter '{node.name}'" + did_you_mean(node.name, _ENV.filters))
        elif node.name == "attr" and node.args and isinstance(node.args[0], nodes.Const) and str(node.args[0].value).startswith("__"):
            problems.append(f"{where}: attribute '{node.args[0].value}' is blocked by the sandbox (dunder attributes are not accessible)")
    for node in ast.find_all(nodes.Test):
        if node.name not in _ENV.tests:
            problems.append(f"{where}: unknown test '{node.name}'" + did_you_mean(node.name, _ENV.tests))
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            name = node.arg.value
        else:
            continue
        if name.startswith("__"):
            problems.append(f"{where}: attribute '{name}' is blocked by the sandbox (dunder attributes are not accessible)")
    return problems


def _field_problems(ast, json_fields: Mapping[str, list[str]], roots: set[str], where: str) -> list[str]:
    """``{{ card.subjct }}`` where output ``card`` is JSON with declared fields that lack ``subjct``."""
    problems = []
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        base = node.node
        if not (isinstance(base, nodes.Name) and base.ctx == "load" and base.name in json_fields and base.name in roots):
            continue
        if isinstance(node, nodes.Getattr):
            name = node.attr
            if name in _DICT_ATTRS:  # card.items(), card.get('x'): dict methods, as Jinja2 finds them
                continue
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            name = node.arg.value
        else:
            continue
        fields = json_fields[base.name]
        if name not in fields and not name.startswith("_"):
            problems.append(
                f"{where}: '{base.name}.{name}': output '{base.name}' has no field '{name}' in its output_schema "
                f"(fields: {', '.join(fields)})" + did_you_mean(name, fields)
            )
    return problems


def template_problems(source: str, known: Iterable[str], where: str, json_fields: Mapping[str, list[str]] | None = None) -> list[str]:
    """Syntax errors, variables that are neither inputs nor earlier outputs, fields a JSON
    output's schema does not declare (``json_fields``: output name -> field names, for JSON
    outputs with a declared schema), and what the sandbox cannot run (``sandbox_problems``)."""
    try:
        ast = _ENV.parse(source)
    except jinja2.TemplateSyntaxError as e:
        return [f"{where}: template syntax error on line {e.lineno}: {e.message}"]
    known = list(known)
    problems = sandbox_problems(ast, where)
    if problems:  # the compiler (find_undeclared_variables) would raise on an unknown filter or test
        return problems
    try:
        undeclared = meta.find_undeclared_variables(ast)
        _ENV.compile(ast)
    except jinja2.TemplateError as e:  # anything else the compiler refuses
        return [f"{where}: template error: {getattr(e, 'message', None) or e}"]
    for name in sorted(undeclared):
        if name not in known:
            problems.append(f"{where}: unknown variable '{name}'" + did_you_mean(name, known))
    if json_fields:
        problems += _field_problems(ast, json_fields, undeclared, where)
    problems += cost_problems(ast, where)
    return problems


_BRACED = re.compile(r"^\s*\{\{(.*)\}\}\s*$", re.S)


def predicate_expression(predicate: str) -> str:
    """The expression of a filter's predicate; ``{{ score > 33 }}`` is accepted for ``score > 33``."""
    m = _BRACED.match(predicate)
    return m.group(1) if m else predicate


def predicate_problems(predicate: str, known, where: str, json_fields=None) -> list[str]:
    """Syntax errors, unknown variables, undeclared JSON fields of a filter's predicate (as a prompt's)."""
    expr = predicate_expression(predicate)
    if not expr.strip():
        return [f"{where}: empty predicate (a Jinja2 expression such as 'score > 33')"]
    return template_problems("{{ (" + expr + ") }}", known, where, json_fields)


def record_template_problems(shape: Any, known: Iterable[str], where: str, json_fields: Mapping[str, list[str]] | None = None) -> list[str]:
    known = list(known)
    if isinstance(shape, dict):
        return [p for k, v in shape.items() for p in record_template_problems(v, known, f"{where}.{k}", json_fields)]
    if isinstance(shape, list):
        return [p for i, v in enumerate(shape) for p in record_template_problems(v, known, f"{where}[{i}]", json_fields)]
    if isinstance(shape, str):
        return template_problems(shape, known, where, json_fields)
    return []


# --------------------------------------------------------------------------- fast paths

_MISS = object()
_DICT_ATTRS = frozenset(dir(dict))  # jinja's x.key finds these methods before a dict key


def fast_renderer(template: jinja2.Template) -> Callable[[Mapping[str, Any]], str]:
    """``template.render(variables)``, with the template's globals merged into the context once.

    ``Template.render`` copies the variables and iterates the ChainMap of globals on every
    call; a shared context over one prebuilt dict renders the same text.
    """
    env, name, blocks, root = template.environment, template.name, template.blocks, template.root_render_func
    globals_ = dict(template.globals)
    concat = env.concat

    def render(variables: Mapping[str, Any]) -> str:
        ctx = _new_context(env, name, blocks, {**globals_, **variables}, True, None)
        try:
            return concat(root(ctx))
        except Exception:
            env.handle_exception()

    return render


def _var_path(node) -> tuple[str, ...] | None:
    """``name`` or ``name.a.b`` as a path; None for any other expression."""
    attrs = []
    while isinstance(node, nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    if isinstance(node, nodes.Name) and node.ctx == "load":
        return (node.name, *reversed(attrs))
    return None


def _lookup(variables: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value Jinja2 finds for a path when it is made of plain dict keys, else _MISS."""
    if type(variables) is not dict:
        return _MISS
    value = variables.get(path[0], _MISS)
    for key in path[1:]:
        if value is _MISS or type(value) is not dict or key in _DICT_ATTRS:
            return _MISS
        value = value.get(key, _MISS)
    return value


def _text_and_paths(ast) -> list | None:
    """A template that is only text and variable paths, as [str | tuple], else None."""
    parts: list = []
    for node in ast.body:
        if not isinstance(node, nodes.Output):
            return None
        for child in node.nodes:
            if isinstance(child, nodes.TemplateData):
                parts.append(child.data)
            else:
                path = _var_path(child)
                if path is None:
                    return None
                parts.append(path)
    return parts


def _field_path(parsed: dict) -> tuple[str, ...] | None:
    """A JMESPath AST that is a field or a chain of fields, as a path; else None."""
    if parsed.get("type") == "field":
        return (parsed["value"],)
    if parsed.get("type") == "subexpression":
        path: tuple[str, ...] = ()
        for child in parsed["children"]:
            sub = _field_path(child)
            if sub is None:
                return None
            path += sub
        return path
    return None


# JMESPath nodes whose first child is evaluated on the current value and the others on what it gives
_LEFT_FIRST = {"subexpression", "index_expression", "projection", "value_projection", "filter_projection", "pipe", "flatten"}
# nodes whose children are all evaluated on the current value
_ALL_CHILDREN = {"multi_select_list", "multi_select_dict", "key_val_pair", "function_expression", "or_expression",
                 "and_expression", "not_expression", "comparator"}  # fmt: skip


def jmespath_roots(parsed: dict) -> set[str] | None:
    """The top-level fields of the row a JMESPath AST can read; None when it can read the
    whole row (``@``, ``*``, ``keys(@)``, a node this does not know)."""
    kind = parsed.get("type")
    if kind == "field":
        return {parsed["value"]}
    if kind == "literal" or kind == "expref":  # an expref runs on the elements another argument gives
        return set()
    if kind in _LEFT_FIRST:
        return jmespath_roots(parsed["children"][0])
    if kind in _ALL_CHILDREN:
        out: set[str] = set()
        for child in parsed["children"]:
            roots = jmespath_roots(child)
            if roots is None:
                return None
            out |= roots
        return out
    return None


def columns_read(inputs, remove_columns: bool, preserve_columns=()) -> frozenset[str] | None:
    """The top-level columns of a row the pipeline reads: the inputs' JMESPath roots and the
    preserved columns; None (every column) when records keep the row (remove_columns false)
    or an input can read the whole row. Python steps and templates see variables only."""
    if not remove_columns:
        return None
    out = set(preserve_columns)
    for v in inputs:
        roots = jmespath_roots(compile_jmespath(v.key).parsed)
        if roots is None:
            return None
        out |= roots
    return frozenset(out)


class _FieldSearch:
    """``jmespath.compile('a.b').search(row)`` for field chains, as TreeInterpreter does it."""

    def __init__(self, path: tuple[str, ...]):
        self.path = path

    def search(self, value):
        for key in self.path:
            try:
                value = value.get(key)
            except AttributeError:
                return None
            if value is None:
                return None
        return value


# --------------------------------------------------------------------------- extraction


class Extractor:
    """Evaluates each input's compiled JMESPath on a row."""

    _MISSING = object()

    def __init__(self, inputs):
        self._inputs = []
        for v in inputs:
            expr = compile_jmespath(v.key)
            path = _field_path(expr.parsed)
            self._inputs.append((v.name, _FieldSearch(path) if path else expr, v.default if v.has_default else self._MISSING, v.key))

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        if type(row) is not dict and not isinstance(row, _abc.Mapping):  # typing.Mapping's check costs ~5 us
            raise RowError("extract", E.BAD_ROW, f"row is a {type(row).__name__}, not an object")
        values = {}
        for name, expr, default, key in self._inputs:
            try:
                value = expr.search(row)
            except Exception as e:  # e.g. a JMESPath function applied to the wrong type in this row
                raise RowError("extract", E.EXTRACT_ERROR, f"input '{name}': key '{key}': {type(e).__name__}: {e}") from None
            if value is None:
                if default is self._MISSING:
                    raise RowError("extract", E.MISSING_VARIABLE, f"input '{name}': key '{key}' not found in the row")
                value = default
            values[name] = value
        return values


# --------------------------------------------------------------------------- templates


def _render_error(where: str, e: BaseException) -> RowError:
    if isinstance(e, (RenderTimeout, RenderTooLarge)):  # past a render's limits: its own class
        kind, message = limit_message(e)
        return RowError("render", kind, f"{where}: {message}")
    return RowError("render", E.TEMPLATE_ERROR, f"{where}: {type(e).__name__}: {e}")


class Template:
    def __init__(self, source: str, where: str):
        self.where = where
        self._template = _ENV.from_string(source)
        self._render = fast_renderer(self._template)
        self._parts = _text_and_paths(_ENV.parse(source))
        if self._parts is not None and all(isinstance(p, str) for p in self._parts):
            self._constant: str | None = "".join(self._parts)
        else:
            self._constant = None

    def render(self, variables: Mapping[str, Any]) -> str:
        if self._constant is not None:
            return self._constant
        if self._parts is not None:
            out = []
            for part in self._parts:
                if part.__class__ is str:
                    out.append(part)
                    continue
                value = _lookup(variables, part)
                if value is _MISS:
                    break  # not a plain dict key: let Jinja2 decide (global, method, error)
                out.append(str(value))
            else:
                return "".join(out)
        try:
            return guarded(self._render, variables)
        except (Exception, RenderTimeout, RenderTooLarge) as e:  # any template failure is this row's problem only
            raise _render_error(self.where, e) from None


def _compile_value(shape: Any, where: str) -> Callable[[Mapping[str, Any]], Any]:
    if isinstance(shape, dict):
        parts = [(k, _compile_value(v, f"{where}.{k}")) for k, v in shape.items()]
        return lambda vs: {k: f(vs) for k, f in parts}
    if isinstance(shape, list):
        items = [_compile_value(v, f"{where}[{i}]") for i, v in enumerate(shape)]
        return lambda vs: [f(vs) for f in items]
    if not isinstance(shape, str):
        return lambda vs: shape
    lone = _LONE_EXPR.match(shape)
    if lone and "{{" not in lone.group(1) and "{%" not in shape:
        # "{{ var }}" keeps the variable's own type (dict, list, number), as in MMIRAGE.
        expr = _ENV.compile_expression(lone.group(1), undefined_to_none=False)
        body = _ENV.parse("{{" + lone.group(1) + "}}").body
        path = _var_path(body[0].nodes[0]) if len(body) == 1 and len(body[0].nodes) == 1 else None

        def evaluate(vs):
            if path is not None:
                value = _lookup(vs, path)
                if value is not _MISS:
                    return value
            try:
                value = guarded(expr, vs)
            except (Exception, RenderTimeout, RenderTooLarge) as e:
                raise _render_error(where, e) from None
            if isinstance(value, jinja2.Undefined):
                raise RowError("render", E.TEMPLATE_ERROR, f"{where}: {lone.group(1).strip()!r} is undefined")
            return value

        return evaluate
    return Template(shape, where).render


# Fields the workflow writes into every record (sample_index with n_samples > 1): a variable,
# output or output_schema field of that name would be overwritten, so the config refuses it.
RESERVED_RECORD_FIELDS = ("source_index", "sample_index")


class RecordRenderer:
    """Builds the saved record of a row from processing_params.output_schema."""

    def __init__(self, output_schema: dict, remove_columns: bool, output_names: list[str], preserve_columns=(), always=()):
        """``always``: variables every record holds whatever output_schema says (an image
        output's ``<name>_path`` and ``<name>_seed``)."""
        self._shape = _compile_value(output_schema, "processing_params.output_schema") if output_schema else None
        self._remove_columns = remove_columns
        self._output_names = output_names
        self._always = tuple(always)
        # columns kept in spite of remove_columns (null where a row lacks one: one schema for all parts)
        self._preserve = tuple(preserve_columns) if remove_columns else ()
        # source_index: a built-in variable of output_schema (MMIRAGE renders it too); a field of
        # that name must hold the row's index, which the workflow writes there (the merge orders by it)
        self._uses_index = bool(output_schema) and "source_index" in json.dumps(output_schema, default=str)
        self._index_field = isinstance(output_schema, Mapping) and "source_index" in output_schema

    def __call__(self, source_index: int, row: Mapping[str, Any], variables: Mapping[str, Any], sample_index: int | None = None) -> dict:
        if self._shape is not None:
            if self._uses_index and "source_index" not in variables:
                variables = {**variables, "source_index": source_index}
            rendered = self._shape(variables)
            if self._index_field and not same_index(rendered.get("source_index"), source_index):
                raise RowError(
                    "render", E.TEMPLATE_ERROR,
                    f"processing_params.output_schema.source_index: {rendered.get('source_index')!r} is not this row's "
                    f"source_index {source_index}, which every record holds (the merge orders records by it)",
                )  # fmt: skip
        else:
            rendered = {name: variables[name] for name in self._output_names}
        for name in self._always:
            rendered.setdefault(name, variables.get(name))
        if not self._remove_columns:
            record = {**row, **rendered}
        elif self._preserve:
            record = {**{c: row.get(c) for c in self._preserve}, **rendered}
        else:
            record = dict(rendered)
        record["source_index"] = source_index
        if sample_index is not None:  # n_samples > 1 (mirageflow/shard/samples.py)
            record["sample_index"] = sample_index
        return record


def same_index(value: Any, index: int) -> bool:
    return value == index or (isinstance(value, str) and value.strip() == str(index))


# ShareGPT's speaker names (``from``) -> chat roles; OpenAI-style rows use the roles themselves.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")


def _conversation_error(name: str, message: str) -> RowError:
    return RowError("render", E.BAD_CONVERSATION, f"input '{name}': {message}")


def conversation_messages(value: Any, name: str, prompt_follows: bool) -> list[dict[str, str]]:
    """A row's conversation as chat messages ``[{role, content}]``.

    Accepts OpenAI style ``[{role: system|user|assistant, content: str}]`` and ShareGPT
    style ``[{from: human|gpt|system (or user|assistant), value: str}]``; other keys of a
    message (``name``, ``weight``, ...) are ignored. A system message may only come first.
    Without a prompt after it (``prompt_follows``) the conversation must end with a user
    turn, the one the model answers. Anything else is the row's ``bad_conversation``
    error naming the variable ``name`` and the message.
    """
    if not isinstance(value, (list, tuple)):
        raise _conversation_error(name, f"is a {type(value).__name__}, not a list of chat messages")
    if not value:
        raise _conversation_error(name, "is an empty list of chat messages")
    msgs = []
    for i, m in enumerate(value):
        if not isinstance(m, _abc.Mapping):
            raise _conversation_error(name, f"message {i} is a {type(m).__name__}, not an object with role and content")
        if "role" in m and "from" not in m:
            role, content, key = m["role"], m.get("content"), "content"
            if role not in CHAT_ROLES:
                raise _conversation_error(name, f"message {i} has unknown role {role!r} (known: {', '.join(CHAT_ROLES)})")
        elif "from" in m and "role" not in m:
            speaker, content, key = m["from"], m.get("value"), "value"
            role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
            if role is None:
                raise _conversation_error(name, f"message {i} has unknown speaker 'from': {speaker!r} (known: {', '.join(SHAREGPT_ROLES)})")
        else:
            raise _conversation_error(
                name,
                f"message {i} needs either 'role' and 'content' (OpenAI) or 'from' and 'value' (ShareGPT), it has keys {sorted(map(str, m))}",
            )
        if not isinstance(content, str):
            raise _conversation_error(
                name, f"message {i} ({role}): '{key}' is {'missing' if content is None else 'a ' + type(content).__name__}, not text"
            )
        if role == "system" and i:
            raise _conversation_error(name, f"message {i}: a system message may only be the first message")
        msgs.append({"role": role, "content": content})
    if not prompt_follows and msgs[-1]["role"] != "user":
        raise _conversation_error(
            name,
            f"ends with a{'n' if msgs[-1]['role'] == 'assistant' else ''} {msgs[-1]['role']} turn: nothing for the model to answer "
            "(the last message must be the user's, or set the output's prompt to add a last user turn)",
        )
    return msgs


class PromptBuilder:
    """Chat messages for one output: an optional system prompt, then the user prompt.

    With ``conversation`` (the name of a variable holding a list of chat messages), the
    messages are that conversation, then the output's prompt (when it has one) as a last
    user turn; the output's ``system`` replaces the conversation's own system message.
    """

    def __init__(self, output: OutputVar):
        self.output = output
        where = f"outputs.{output.name}"
        self._user = Template(output.prompt, f"{where}.prompt") if output.prompt else None
        self._system = Template(output.system, f"{where}.system") if output.system else None
        self._conversation = output.conversation

    def messages(self, variables: Mapping[str, Any]) -> list[dict[str, str]]:
        msgs = []
        if self._system is not None:
            msgs.append({"role": "system", "content": self._system.render(variables)})
        if self._conversation is not None:
            turns = conversation_messages(variables.get(self._conversation), self._conversation, self._user is not None)
            if msgs and turns[0]["role"] == "system":
                turns = turns[1:]  # the output's system prompt takes its place
            msgs += turns
        if self._user is not None:
            msgs.append({"role": "user", "content": self._user.render(variables)})
        return msgs
