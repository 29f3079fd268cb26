"""config/types.py against the schema: defaults, choices, fallbacks and the keys that change nothing.

The schema fills every default while a config is validated (config/loading.py), so it is the
source; a dataclass default only serves a value built without the loader (a test, a default
``ExecutionParams()``). These tests hold the two to the same values, each choice's Literal to
the schema's enum, the package to reading typed config without ``getattr`` fallbacks, and
``IGNORED_MMIRAGE_KEYS`` to the schema and docs/mmirage.md.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest
import schema_docs
from fakes.configs import pipeline_config

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
    T.LaunchedServer: [("processors", "[]")],
    T.ApiOptions: [("processors", "[]")],
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
KEY_OF = {
    (T.BatchSettings, "endpoint"): "batch_endpoint",
    (T.ImageGenProcessor, "default_params"): "default_sampling_params",
    **{(T.LaunchedServer, name): key for key, name in build.LAUNCH_KEYS.items()},
}
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

    assert default_disagreements(Shard, _properties(T.ShardParams)) == ["Shard.checkpoint_rows: dataclass 499, schema 500"]


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
    (T.DatasetConfig, "shard_boundaries"): (T.ShardBoundaries, _enum("loading_params", "datasets", "[]", "shard_boundaries")),
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


# --------------------------------------------------------------------------- one option group per backend

# processors[] keys that only some backends read: each is a field of one option group, none of ProcessorConfig
# itself (the schema keeps them flat in processors[])
GROUPED_KEYS = {
    "launch": (T.LaunchedServer, set(build.LAUNCH_KEYS)),
    "api": (T.ApiOptions, set(build.API_KEYS)),
    "batch": (T.BatchSettings, {"provider", "max_chunk_bytes", "max_requests_per_chunk", "completion_window", "poll_seconds"}),
}


def test_processor_config_holds_no_backends_own_key():
    own = {f.name for f in dataclasses.fields(T.ProcessorConfig)}
    assert own & set().union(*(keys for _, keys in GROUPED_KEYS.values())) == set()
    for group, (cls, keys) in GROUPED_KEYS.items():
        assert {KEY_OF.get((cls, f.name), f.name) for f in dataclasses.fields(cls)} >= keys, group
        assert eval({f.name: f.type for f in dataclasses.fields(T.ProcessorConfig)}[group], vars(T)) == cls | None


def _processor(tmp_path, **keys) -> T.ProcessorConfig:
    raw = pipeline_config(tmp_path / "in.jsonl", model="m", processor=keys)
    (proc,) = loading.load_config(raw, check_paths=False).processors.values()
    return proc


# backend -> the option groups its processors have (auto: those of every backend it may pick; its vllm_server is
# fed through the openai backend)
GROUPS = {
    "transformers": set(),
    "sglang": set(),
    "sglang_server": {"launch"},
    "vllm_server": {"launch"},
    "openai": {"api"},
    "auto": {"launch", "api"},
}


@pytest.mark.parametrize("backend", list(GROUPS))
def test_each_backend_has_its_option_groups(tmp_path, backend):
    url = {"base_url": "http://h:1/v1"} if registry.capabilities(backend).needs_base_url else {}
    proc = _processor(tmp_path, backend=backend, server_command=["launcher"], max_concurrency=3, max_restarts=1, **url)
    assert proc.max_restarts == 1  # every backend's: a launched server restarted, a transformers model reloaded
    assert {group for group in GROUPED_KEYS if getattr(proc, group) is not None} == GROUPS[backend]
    if proc.launch is not None:
        assert (proc.launch.command, proc.launch.start_timeout) == (["launcher"], 900)
    if proc.api is not None:
        assert (proc.api.max_concurrency, proc.api.retry_base_delay) == (3, None)


def _of_type(tmp_path, entry: dict) -> T.ProcessorConfig:
    raw = pipeline_config(tmp_path / "in.jsonl")
    raw["processors"] = [entry]
    raw["processing_params"]["outputs"][0]["type"] = entry["type"]
    return loading.load_config(raw, check_paths=False).processors[entry["type"]]


def test_a_batch_processor_has_only_the_batch_group(tmp_path):
    proc = _of_type(tmp_path, {"type": "batch_api", "provider": "openai"})
    assert (proc.launch, proc.api, proc.batch.provider) == (None, None, "openai")


def test_an_api_llm_processor_has_the_api_group_with_mmirages_defaults(tmp_path):
    proc = _of_type(tmp_path, {"type": "api_llm", "model": "gpt", "max_concurrency": 2})
    assert (proc.backend, proc.launch, proc.api) == ("openai", None, T.ApiOptions(max_concurrency=2, retry_base_delay=1.0))


def test_a_groups_key_on_a_backend_without_the_group_is_said_to_change_nothing(tmp_path):
    raw = pipeline_config(
        tmp_path / "in.jsonl", model="m", processor={"backend": "sglang", "server_env": {"A": 1}, "retry_base_delay": 2.0}
    )
    warnings = loading.load_config(raw, check_paths=False).warnings
    assert [w for w in warnings if "changes nothing for backend" in w] == [
        "processors[0].server_env: changes nothing for backend sglang (only sglang_server and vllm_server launch a server)",
        "processors[0].retry_base_delay: changes nothing for backend sglang (only backend openai and type api_llm read it)",
    ]


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


# --------------------------------------------------------------------------- MMIRAGE keys that change nothing

_SAYS_UNUSED = re.compile(r"\b(unused|not used|ignored|changes nothing)\b", re.IGNORECASE)


def _schema_entry(key: str) -> dict:
    """The schema's entry of a key path written as in IGNORED_MMIRAGE_KEYS (``processors[].sglang.port``)."""
    path = tuple(part for name in key.split(".") for part in ((name[:-2], "[]") if name.endswith("[]") else (name,)))
    *section, name = path
    return _node(tuple(section))["properties"][name]


def _with_ignored_keys(tmp_path) -> dict:
    """A config that sets every ignored key (an image_gen processor holds sglang.port)."""
    raw = pipeline_config(
        tmp_path / "in.jsonl", model="m",
        loading={"shard_id": "$SLURM_ARRAY_TASK_ID"},
        processor={"chat_template": "qwen2-vl"},
        execution_params={
            "job_name": "j", "poll_interval_seconds": 5, "settle_time_seconds": 2, "project_root": "/p", "report_dir": "/r",
            "edf_env": "/e.toml",
        },
    )  # fmt: skip
    raw["processors"] += [
        {"type": "custom", "script_path": "steps.py", "function_name": "f", "max_timeouts": 2, "max_errors": 3, "fallback_value": ""},
        {"type": "image_gen", "backend": "sglang", "sglang": {"model_path": "m", "port": 30000}},
    ]
    return raw


def _sets(node, parts: list[str]) -> bool:
    """Whether the config mapping sets the key path (``processors[]``: in any entry)."""
    if not parts:
        return True
    name, rest = parts[0], parts[1:]
    if name.endswith("[]"):
        return any(_sets(entry, rest) for entry in node.get(name[:-2], []))
    return isinstance(node, dict) and name in node and _sets(node[name], rest)


def test_every_ignored_mmirage_key_is_accepted(tmp_path):
    raw = _with_ignored_keys(tmp_path)
    assert [key for key in T.IGNORED_MMIRAGE_KEYS if not _sets(raw, key.split("."))] == []
    cfg = loading.load_config(raw, check_paths=False)
    assert any("chat_template" in w for w in cfg.warnings)


def test_no_typed_field_holds_an_ignored_key():
    """What changes nothing has no field to read (fallback_value stays, to warn that it is not used)."""
    held = {"processors[].fallback_value": T.CustomProcessor}
    for key in T.IGNORED_MMIRAGE_KEYS:
        name = key.rsplit(".", 1)[1]
        holders = [cls.__name__ for cls in SECTIONS if name in {f.name for f in dataclasses.fields(cls)} and held.get(key) is not cls]
        if key.startswith("execution_params."):
            assert T.ExecutionParams.__name__ not in holders, key
        elif key.startswith("processors[]."):
            assert not {"CustomProcessor", "ImageGenProcessor"} & set(holders), key


def test_every_ignored_key_is_documented_as_such():
    """The schema, config/README.md's key reference (schema_docs marks each) and docs/mmirage.md's table say it
    changes nothing."""
    readme = (PACKAGE.parents[1] / "docs" / "mmirage.md").read_text()
    reference = (PACKAGE.parents[1] / "config" / "README.md").read_text()  # generated by scripts/schema_docs.py
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "accepted" in line]
    for key, why in T.IGNORED_MMIRAGE_KEYS.items():
        assert why
        assert _SAYS_UNUSED.search(" ".join(_schema_entry(key)["description"].split())), key
        written = {f"`{'.'.join(key.split('.')[-n:])}`" for n in (1, 2)}
        assert any(w in row for w in written for row in rows), key  # `port` or `sglang.port`
        (row,) = [line for line in reference.splitlines() if line.startswith(f"| `{key}` | ")]
        assert schema_docs.IGNORED_MARK in row, key


def test_every_key_the_schema_calls_unused_is_declared():
    """The other way round: a key described as unused in the schema is in the one list."""

    def walk(node: dict, path: str):
        for name, sub in node.get("properties", {}).items():
            key = f"{path}.{name}" if path else name
            description = " ".join(str(sub.get("description", "")).split())
            if re.match(r"(unused|ignored)\b", description, re.IGNORECASE) or "accepted for MMIRAGE files, not used" in description.lower():
                yield key
            if sub.get("type") == "array" or "items" in sub:
                yield from walk(sub.get("items", {}), f"{key}[]")
            yield from walk(sub, key)

    assert set(walk(loading.schema(), "")) - set(T.IGNORED_MMIRAGE_KEYS) == set()
