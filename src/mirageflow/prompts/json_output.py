"""JSON outputs: the three MMIRAGE output_schema forms, their JSON Schema, and parsing model text.

A model answer that does not parse or does not validate is a row error (OutputError),
never an empty object.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from mirageflow.errors import MirageflowError, RowErrorClass as E

_TYPES = {
    "str": "string", "string": "string",
    "int": "integer", "integer": "integer",
    "float": "number", "number": "number",
    "bool": "boolean", "boolean": "boolean",
}  # fmt: skip


class SchemaError(MirageflowError, ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class OutputError(MirageflowError, ValueError):
    """The model's text is not a JSON object matching the output schema."""

    def __init__(self, kind: str, message: str):
        self.kind = kind  # json_parse | json_schema | json_truncated
        super().__init__(message)


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # JSON Schema type
    minimum: float | None = None
    maximum: float | None = None


def _bound(value: Any, where: str, ftype: str, problems: list[str]) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        problems.append(f"{where}: bound must be a number, got {value!r}")
        return None
    try:
        number = float(value) if not isinstance(value, (int, float)) else value
    except (TypeError, ValueError):
        problems.append(f"{where}: bound must be a number, got {value!r}")
        return None
    if not math.isfinite(number):  # a NaN bound would silently accept everything
        problems.append(f"{where}: bound must be a number, got {value!r}")
        return None
    if isinstance(number, float) and number.is_integer() and isinstance(value, str) and "." not in value:
        number = int(number)
    if ftype == "integer" and not float(number).is_integer():
        problems.append(f"{where}: fractional bound {value!r} on an integer field")
        return None
    return number


@dataclass(frozen=True)
class OutputSchema:
    fields: tuple[Field, ...]

    @classmethod
    def parse(cls, spec: Any, where: str) -> "OutputSchema":
        """Accept a list of names, a mapping name -> type, or name -> {type, min, max}."""
        problems: list[str] = []
        fields = []
        if isinstance(spec, list):
            for i, name in enumerate(spec):
                if not isinstance(name, str) or not name:
                    problems.append(f"{where}[{i}]: field names must be non-empty strings")
                else:
                    fields.append(Field(name, "string"))
        elif isinstance(spec, dict):
            for name, desc in spec.items():
                fwhere = f"{where}.{name}"
                if isinstance(desc, str) or desc is None:
                    desc = {"type": desc}
                if not isinstance(desc, dict):
                    problems.append(f"{fwhere}: expected a type name or a mapping with type/min/max")
                    continue
                for key in sorted(set(desc) - {"type", "min", "max"}):
                    problems.append(f"{fwhere}.{key}: unknown key (allowed: type, min, max)")
                tname = desc.get("type")
                if tname is None:
                    problems.append(f"{fwhere}.type: missing type")
                    continue
                ftype = _TYPES.get(str(tname).lower())
                if ftype is None:
                    problems.append(f"{fwhere}.type: unknown type {tname!r} (use one of {', '.join(sorted(_TYPES))})")
                    continue
                has_bounds = desc.get("min") is not None or desc.get("max") is not None
                if has_bounds and ftype not in ("integer", "number"):
                    problems.append(f"{fwhere}: min/max are only allowed on numeric fields, not {tname!r}")
                    continue
                lo = _bound(desc.get("min"), f"{fwhere}.min", ftype, problems)
                hi = _bound(desc.get("max"), f"{fwhere}.max", ftype, problems)
                if lo is not None and hi is not None and lo > hi:
                    problems.append(f"{fwhere}: min {lo} is greater than max {hi}")
                fields.append(Field(name, ftype, lo, hi))
        else:
            problems.append(f"{where}: expected a list of field names or a mapping")
        if problems:
            raise SchemaError(problems)
        return cls(tuple(fields))

    def json_schema(self) -> dict:
        """The JSON Schema of a valid answer (also what SGLang's json_schema takes, as a string)."""
        props = {}
        for f in self.fields:
            prop: dict[str, Any] = {"type": f.type}
            if f.minimum is not None:
                prop["minimum"] = f.minimum
            if f.maximum is not None:
                prop["maximum"] = f.maximum
            props[f.name] = prop
        return {"type": "object", "properties": props, "required": [f.name for f in self.fields]}

    def validator(self) -> "FastValidator":
        return FastValidator(self)


# Draft 7's type checks (jsonschema._types.draft7_type_checker), for the fields we generate.
_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, numbers.Number) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


class FastValidator:
    """The Draft7Validator of an OutputSchema, with a fast path for valid answers.

    Our schemas are flat (an object, typed properties, optional inclusive bounds, all
    required), so a valid answer is recognised with a few isinstance checks and
    comparisons that mirror Draft 7 exactly (``integer`` accepts 3.0, ``bool`` is not a
    number). Anything else, and every error message, comes from jsonschema itself.
    """

    def __init__(self, schema: OutputSchema):
        self.schema = schema.json_schema()
        self.jsonschema = jsonschema.Draft7Validator(self.schema)
        self._checks = [(f.name, _TYPE_CHECKS[f.type], f.minimum, f.maximum) for f in schema.fields]

    def _valid(self, instance: dict) -> bool:
        for name, check, lo, hi in self._checks:
            if name not in instance:
                return False
            value = instance[name]
            if not check(value):
                return False
            if lo is not None and value < lo:
                return False
            if hi is not None and value > hi:
                return False
        return True

    def iter_errors(self, instance):
        if type(instance) is dict and self._valid(instance):
            return iter(())
        return self.jsonschema.iter_errors(instance)

    def is_valid(self, instance) -> bool:
        return (type(instance) is dict and self._valid(instance)) or self.jsonschema.is_valid(instance)


_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.S)


def parse_answer(text: str, validator: "FastValidator | jsonschema.Draft7Validator", truncated: bool) -> dict:
    """Parse a model's answer as a JSON object and validate it.

    Tolerates a Markdown code fence and text around one top-level object; nothing else.
    """
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested deeper than Python's stack
        start, end = body.find("{"), body.rfind("}")
        try:
            value = json.loads(body[start : end + 1]) if 0 <= start < end else None
        except (json.JSONDecodeError, RecursionError):
            value = None
        if value is None:
            if truncated:
                raise OutputError(E.JSON_TRUNCATED, "JSON answer was cut off by max_new_tokens") from None
            raise OutputError(E.JSON_PARSE, f"answer is not valid JSON: {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise OutputError(E.JSON_SCHEMA, f"answer is a JSON {type(value).__name__}, not an object")
    errors = sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        msgs = [f"{'.'.join(map(str, e.absolute_path)) or '<object>'}: {e.message}" for e in errors]
        raise OutputError(E.JSON_SCHEMA, "; ".join(msgs))
    return value
