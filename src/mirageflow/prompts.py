"""Rows -> variables -> prompts -> records: JMESPath extraction, Jinja2 templates, chat messages.

Everything is compiled once per config; per row only evaluation happens. Templates run
in Jinja2's sandbox with StrictUndefined, so a missing attribute is a row error, not an
empty string.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Iterable, Mapping

import jinja2
import jmespath
import jmespath.exceptions
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)
_LONE_EXPR = re.compile(r"^\s*\{\{(.*?)\}\}\s*$", re.S)


class RowError(Exception):
    """One row failed at one stage; the shard records it and goes on."""

    def __init__(self, stage: str, kind: str, message: str, raw: str | None = None):
        self.stage, self.kind, self.raw = stage, kind, raw
        super().__init__(message)


# --------------------------------------------------------------------------- validation helpers


def compile_jmespath(expr: str):
    try:
        return jmespath.compile(expr)
    except jmespath.exceptions.ParseError as e:
        raise ValueError(f"invalid JMESPath expression {expr!r}: {e}") from None


def template_problems(source: str, known: Iterable[str], where: str) -> list[str]:
    """Syntax errors and variables that are neither inputs nor earlier outputs."""
    try:
        ast = _ENV.parse(source)
    except jinja2.TemplateSyntaxError as e:
        return [f"{where}: template syntax error on line {e.lineno}: {e.message}"]
    known = list(known)
    problems = []
    for name in sorted(meta.find_undeclared_variables(ast)):
        if name not in known:
            hint = difflib.get_close_matches(name, known, n=1)
            problems.append(f"{where}: unknown variable '{name}'" + (f" (did you mean '{hint[0]}'?)" if hint else ""))
    return problems


def record_template_problems(shape: Any, known: Iterable[str], where: str) -> list[str]:
    known = list(known)
    if isinstance(shape, dict):
        return [p for k, v in shape.items() for p in record_template_problems(v, known, f"{where}.{k}")]
    if isinstance(shape, list):
        return [p for i, v in enumerate(shape) for p in record_template_problems(v, known, f"{where}[{i}]")]
    if isinstance(shape, str):
        return template_problems(shape, known, where)
    return []


# --------------------------------------------------------------------------- extraction


class Extractor:
    """Evaluates each input's compiled JMESPath on a row."""

    _MISSING = object()

    def __init__(self, inputs):
        self._inputs = [(v.name, compile_jmespath(v.key), v.default if v.has_default else self._MISSING, v.key) for v in inputs]

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise RowError("extract", "bad_row", f"row is a {type(row).__name__}, not an object")
        values = {}
        for name, expr, default, key in self._inputs:
            value = expr.search(row)
            if value is None:
                if default is self._MISSING:
                    raise RowError("extract", "missing_variable", f"input '{name}': key '{key}' not found in the row")
                value = default
            values[name] = value
        return values


# --------------------------------------------------------------------------- templates


def _render_error(where: str, e: Exception) -> RowError:
    return RowError("render", "template_error", f"{where}: {type(e).__name__}: {e}")


class Template:
    def __init__(self, source: str, where: str):
        self.where = where
        self._template = _ENV.from_string(source)

    def render(self, variables: Mapping[str, Any]) -> str:
        try:
            return self._template.render(variables)
        except Exception as e:  # any template failure is this row's problem only
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

        def evaluate(vs):
            try:
                value = expr(vs)
            except Exception as e:
                raise _render_error(where, e) from None
            if isinstance(value, jinja2.Undefined):
                raise RowError("render", "template_error", f"{where}: {lone.group(1).strip()!r} is undefined")
            return value

        return evaluate
    return Template(shape, where).render


class RecordRenderer:
    """Builds the saved record of a row from processing_params.output_schema."""

    def __init__(self, output_schema: dict, remove_columns: bool, output_names: list[str]):
        self._shape = _compile_value(output_schema, "processing_params.output_schema") if output_schema else None
        self._remove_columns = remove_columns
        self._output_names = output_names

    def __call__(self, source_index: int, row: Mapping[str, Any], variables: Mapping[str, Any]) -> dict:
        if self._shape is not None:
            rendered = self._shape(variables)
        else:
            rendered = {name: variables[name] for name in self._output_names}
        record = dict(rendered) if self._remove_columns else {**row, **rendered}
        record["source_index"] = source_index
        return record


class PromptBuilder:
    """Chat messages for one output: an optional system prompt, then the user prompt."""

    def __init__(self, output):
        self.output = output
        where = f"outputs.{output.name}"
        self._user = Template(output.prompt, f"{where}.prompt")
        self._system = Template(output.system, f"{where}.system") if output.system else None

    def messages(self, variables: Mapping[str, Any]) -> list[dict[str, str]]:
        msgs = []
        if self._system is not None:
            msgs.append({"role": "system", "content": self._system.render(variables)})
        msgs.append({"role": "user", "content": self._user.render(variables)})
        return msgs
