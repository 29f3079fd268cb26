"""config/types.py against the schema: the dataclasses' defaults and choices are the schema's.

The schema fills every default while a config is validated (config/loading.py), so it is the
source; a dataclass default only serves a value built without the loader (a test, a default
``ExecutionParams()``). These tests hold the two to the same values.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from mirageflow.config import build, loading
from mirageflow.config import types as T
from mirageflow.engines import registry

# dataclass -> the schema mappings whose keys are its fields (a path of property names; [] = items)
SECTIONS: dict[type, list[tuple[str, ...]]] = {
    T.ShardParams: [("shard_params",)],
    T.ExecutionParams: [("execution_params",)],
    T.DedupParams: [("deduplication_params",)],
    T.ProcessorConfig: [("processors", "[]")],
    T.CustomProcessor: [("processors", "[]")],
    T.BatchSettings: [("processors", "[]")],
    T.ImageGenProcessor: [
        ("processors", "[]"),
        ("processors", "[]", "external"),
        ("processors", "[]", "pipeline_args"),
        ("processors", "[]", "sglang"),
    ],
    T.ServerArgs: [("processors", "[]", "server_args")],
    T.DatasetConfig: [("loading_params", "datasets", "[]")],
    T.InputVar: [("processing_params", "inputs", "[]")],
    T.OutputVar: [("processing_params", "outputs", "[]")],
    T.ImageOutput: [("processing_params", "outputs", "[]")],
    T.PipelineConfig: [(), ("loading_params",), ("processing_params",)],
}
# a field whose schema key has another name
KEY_OF = {(T.BatchSettings, "endpoint"): "batch_endpoint", (T.ImageGenProcessor, "default_params"): "default_sampling_params"}
# fields that share a key name with the schema but are not that key's value (the key is another section's)
NOT_THE_KEY = {
    (T.OutputVar, "kind"),  # the output's type resolved to its step kind (llm | custom | filter | image_gen)
    (T.PipelineConfig, "merge"),  # execution_params.merge, not a top-level key
    (T.PipelineConfig, "dedup"),  # the params when enabled, else None
    (T.PipelineConfig, "execution"),
}
# a schema default of null that the builder resolves to the field's default: the key's description says
# to what ("null: 5")
NULL_RESOLVED = {(T.ProcessorConfig, "max_retries"), (T.ImageGenProcessor, "max_retries")}


def _node(path: tuple[str, ...]) -> dict:
    node = loading.schema()
    for part in path:
        node = node["items"] if part == "[]" else node["properties"][part]
    return node


def _properties(cls: type) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for path in SECTIONS[cls]:
        found.update(_node(path).get("properties", {}))
    return found


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def default_disagreements(cls: type, properties: dict[str, dict]) -> list[str]:
    """``Class.field: dataclass X, schema Y`` for each field whose default differs from its schema key's."""
    found = []
    for f in dataclasses.fields(cls):
        ours = _default(f)
        key = KEY_OF.get((cls, f.name), f.name)
        if ours is dataclasses.MISSING or (cls, f.name) in NOT_THE_KEY or "default" not in properties.get(key, {}):
            continue
        theirs = properties[key]["default"]
        if theirs is None and (cls, f.name) in NULL_RESOLVED:
            said = re.search(r"null: (\d+)", " ".join(properties[key]["description"].split()))
            theirs = int(said.group(1)) if said else "no 'null: N' in its description"
        if isinstance(ours, tuple):
            ours = list(ours)
        if ours != theirs or isinstance(ours, bool) != isinstance(theirs, bool):
            found.append(f"{cls.__name__}.{f.name}: dataclass {ours!r}, schema {theirs!r}")
    return found


@pytest.mark.parametrize("cls", list(SECTIONS), ids=lambda c: c.__name__)
def test_dataclass_defaults_are_the_schemas(cls):
    assert default_disagreements(cls, _properties(cls)) == []


def test_every_named_schema_key_exists():
    """The map above names real keys (a renamed key would make the comparison pass by finding nothing)."""
    for (cls, name), key in KEY_OF.items():
        assert key in _properties(cls), (cls.__name__, key)
    for cls, name in [*NOT_THE_KEY, *NULL_RESOLVED]:
        assert name in {f.name for f in dataclasses.fields(cls)}, (cls.__name__, name)


def test_the_comparison_sees_a_disagreement():
    @dataclasses.dataclass
    class Shard:
        checkpoint_rows: int = 499
        request_cache: bool = True
        prefix_order: str = "window"
        lease_timeout_seconds: float = 300.0  # 300 in the schema: equal

    properties = _properties(T.ShardParams)
    SECTIONS[Shard] = SECTIONS[T.ShardParams]
    try:
        assert default_disagreements(Shard, properties) == ["Shard.checkpoint_rows: dataclass 499, schema 500"]
    finally:
        del SECTIONS[Shard]


# --------------------------------------------------------------------------- choices


def _enum(*path: str) -> set:
    *section, key = path
    return set(_node(tuple(section))["properties"][key]["enum"])


_PROCESSOR_TYPES = _enum("processors", "[]", "type")
_BACKENDS = _enum("processors", "[]", "backend")
_OUTPUT_TYPES = _enum("processing_params", "outputs", "[]", "type")
# (class, field) -> its Literal alias and the values it must hold, read from the schema (or the registry)
CHOICES = {
    (T.DatasetConfig, "type"): (T.DatasetType, {v.lower() for v in _enum("loading_params", "datasets", "[]", "type")}),
    (T.DatasetConfig, "output_format"): (T.OutputFormat, _enum("loading_params", "datasets", "[]", "output_format")),
    (T.InputVar, "type"): (T.InputType, _enum("processing_params", "inputs", "[]", "type")),
    # every output type but the two that run as llm steps (build.py's OUTPUT_TYPES maps them)
    (T.OutputVar, "kind"): (T.StepKind, _OUTPUT_TYPES - {"api_llm", "batch_api"}),
    (T.ImageOutput, "output_mode"): (T.ImageOutputMode, _enum("processing_params", "outputs", "[]", "output_mode")),
    (T.ProcessorConfig, "type"): (T.ModelProcessorType, _PROCESSOR_TYPES - {"custom", "image_gen"}),
    (T.CustomProcessor, "type"): (typing.Literal["custom"], {"custom"} & _PROCESSOR_TYPES),
    (T.ImageGenProcessor, "type"): (typing.Literal["image_gen"], {"image_gen"} & _PROCESSOR_TYPES),
    (T.ProcessorConfig, "backend"): (T.LLMBackend, {*registry.config_backends(), "batch_api"}),
    (T.ImageGenProcessor, "backend"): (T.ImageBackend, set(build.IMAGE_BACKENDS)),
    (T.ImageGenProcessor, "torch_dtype"): (T.TorchDtype, _enum("processors", "[]", "pipeline_args", "torch_dtype")),
    (T.ImageGenProcessor, "file_format"): (T.ImageFileFormat, _enum("processors", "[]", "file_format")),
    (T.CustomProcessor, "start_method"): (T.StartMethod, _enum("processors", "[]", "start_method")),
    (T.BatchSettings, "provider"): (T.BatchProvider, _enum("processors", "[]", "provider")),
    (T.BatchSettings, "completion_window"): (T.CompletionWindow, _enum("processors", "[]", "completion_window")),
    (T.BatchSettings, "endpoint"): (T.BatchEndpoint, _enum("processors", "[]", "batch_endpoint")),
    (T.BatchSettings, "oversized_request_policy"): (T.OversizedRequestPolicy, _enum("processors", "[]", "oversized_request_policy")),
    (T.ShardParams, "prefix_order"): (T.PrefixOrder, _enum("shard_params", "prefix_order")),
    (T.ExecutionParams, "mode"): (T.ExecutionMode, _enum("execution_params", "mode")),
}


@pytest.mark.parametrize("where", list(CHOICES), ids=lambda w: f"{w[0].__name__}.{w[1]}")
def test_each_choice_is_a_literal_of_the_schemas_values(where):
    cls, name = where
    alias, values = CHOICES[where]
    assert values, "the schema has no such enum"
    assert set(typing.get_args(alias)) == values
    annotation = {f.name: f.type for f in dataclasses.fields(cls)}[name]  # a string (postponed annotations)
    assert eval(annotation, vars(T)) == alias, annotation  # the field is annotated with it


def test_the_model_and_image_backends_together_are_the_schemas():
    """processors[].backend: the language-model backends a user names and image_gen's (sglang is both)."""
    ours = set(typing.get_args(T.LLMBackend)) - {"batch_api"} | set(typing.get_args(T.ImageBackend))
    assert ours == _BACKENDS
    assert set(typing.get_args(T.ModelProcessorType)) | {"custom", "image_gen"} == _PROCESSOR_TYPES


def test_every_enum_of_a_field_is_a_literal():
    """A field whose schema key has an enum is in CHOICES (a new choice cannot stay a plain str)."""
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in SECTIONS
        for f in dataclasses.fields(cls)
        if "enum" in _properties(cls).get(KEY_OF.get((cls, f.name), f.name), {})
        and (cls, f.name) not in CHOICES
        and (cls, f.name) not in NOT_THE_KEY
    ]
    assert missing == []


# --------------------------------------------------------------------------- reading the config


PACKAGE = Path(loading.__file__).resolve().parents[1]
_FIELDS = {f.name for cls in SECTIONS for f in dataclasses.fields(cls)}
# getattr(x, "<a config field's name>", default) where x is not config: (module, the call) -> what x is
NOT_CONFIG = {
    ("imagegen/diffusers_images.py", "getattr(pipeline, 'dtype', None)"): "a diffusers pipeline object",
}


def config_fallbacks(source: str) -> list[str]:
    """``getattr(x, "name", default)`` calls whose name is a field of a config dataclass, as written."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant) and node.args[1].value in _FIELDS
    ]  # fmt: skip


def test_typed_config_is_read_without_getattr_fallbacks():
    """A typed config has every field: a getattr default would only hide a misspelt name or a stand-in."""
    found = [
        f"{path.relative_to(PACKAGE)}: {call}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for call in config_fallbacks(path.read_text())
        if (str(path.relative_to(PACKAGE)), call) not in NOT_CONFIG
    ]
    assert found == []


def test_the_fallback_finder_sees_one():
    assert config_fallbacks('n = getattr(cfg, "n_samples", 1)\nx = getattr(e, "strerror", None)\nm = getattr(cfg, "n_samples")\n') == [
        "getattr(cfg, 'n_samples', 1)"
    ]
    for (module, call), _ in NOT_CONFIG.items():
        assert call in config_fallbacks((PACKAGE / module).read_text())
