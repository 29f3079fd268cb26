"""Pipeline config: environment expansion, schema validation with defaults, semantic checks.

The schema (workflow/schemas/config.schema.yaml, shipped in the package as
config.schema.yaml) owns keys, types, defaults and descriptions; this module adds the
checks a schema cannot express (template variables, output schemas, paths) and turns
everything into one error that names each offending key path.
"""

from __future__ import annotations

import copy
import functools
import difflib
import glob
import hashlib
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from mirageflow.cluster import resources as cluster
from mirageflow.prompts import json_output
from mirageflow.prompts import templates as prompts
from mirageflow.prompts import python_steps
from mirageflow.data.dedup import DedupParams, produced_fields


class ConfigError(ValueError):
    """Invalid pipeline config; ``problems`` holds one ``key.path: message`` per error."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        head = f"invalid pipeline config{f' {source}' if source else ''}"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in problems))


# --------------------------------------------------------------------------- env vars

_ENV_RE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
# MMIRAGE's per-process shard selector is meaningless here and usually "$SLURM_ARRAY_TASK_ID".
_NOT_EXPANDED = {("loading_params", "shard_id")}
# Templates and what shapes the records are text for the model, not settings: "$5 price" or
# "$SECRET" in a prompt stays as written (never the environment's value, which would be sent
# to the endpoint and written into the records). Key paths, whole subtrees.
_TEMPLATE_KEYS = re.compile(
    r"processing_params\.output_schema|processing_params\.outputs\[\d+\]\.(prompt|system|response_prefix)"
)


def not_expanded(path: str) -> bool:
    """Whether ``$VAR`` expansion skips the value at this key path (templates; loading_params.shard_id)."""
    return path == "loading_params.shard_id" or _TEMPLATE_KEYS.fullmatch(path) is not None


def expand_env(value: Any, environ: Mapping[str, str], path: str, problems: list[str]) -> Any:
    """Expand $VAR, ${VAR}, ${VAR:-default} in every string; $$ is a literal $.

    Not inside templates (outputs' prompt, system and response_prefix, and the record
    templates of processing_params.output_schema) nor loading_params.shard_id: those stay exactly as
    written, ``$$`` included. Values stay strings here; ``coerce_scalars`` types them by
    the schema.
    """
    if isinstance(value, dict):
        return {
            k: v if not_expanded(_join(path, k)) else expand_env(v, environ, _join(path, k), problems)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [expand_env(v, environ, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value

    def substitute(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        if name in environ:
            return environ[name]
        if m.group(2) is not None:
            return m.group(2)
        problems.append(f"{path}: environment variable ${name} is not set (use ${{{name}:-default}} for a default)")
        return m.group(0)

    return _ENV_RE.sub(substitute, value)


def coerce_scalars(value: Any, sch: dict, root: dict) -> Any:
    """Turn strings into numbers/booleans where the schema wants one (``num_shards: ${N}``).

    Driven by the schema, so a string field such as ``account: ${ACC}`` stays a string.
    """
    if "$ref" in sch:
        sch = root["definitions"][sch["$ref"].rsplit("/", 1)[-1]]
    if isinstance(value, dict):
        props = sch.get("properties", {})
        return {k: coerce_scalars(v, props.get(k, {}), root) for k, v in value.items()}
    if isinstance(value, list):
        return [coerce_scalars(v, sch.get("items", {}), root) for v in value]
    types = sch.get("type", [])
    types = [types] if isinstance(types, str) else types
    if isinstance(value, str) and "string" not in types:
        text = value.strip()
        if "integer" in types and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if "number" in types:
            try:
                return float(text)
            except ValueError:
                pass
        if "boolean" in types and text.lower() in ("true", "false"):
            return text.lower() == "true"
    return value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


# --------------------------------------------------------------------------- schema


# libyaml's loader when PyYAML has it: the schema parses in ~20 ms instead of ~300 ms, at the
# start of every job and of every `snakemake` / `mmirage` command.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def schema() -> dict:
    with resources.files("mirageflow.config").joinpath("config.schema.yaml").open(encoding="utf-8") as f:
        return yaml.load(f, Loader=_YAML_LOADER)


def _with_defaults(validator_class):
    """A validator that fills in schema defaults while validating (as snakemake.utils.validate)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft7Validator)


def _error_path(err: jsonschema.ValidationError) -> str:
    path = ""
    for part in err.absolute_path:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, part)
    return path or "<top level>"


def _schema_problems(cfg: dict, sch: dict) -> list[str]:
    problems = []
    for err in sorted(_Validator(sch).iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path))):
        where = _error_path(err)
        if err.validator == "additionalProperties":
            known = sorted(err.schema.get("properties", {}))
            for key in sorted(set(err.instance) - set(known)):
                hint = difflib.get_close_matches(key, known, n=1)
                problems.append(
                    f"{_join('' if where == '<top level>' else where, key)}: unknown key"
                    + (f" (did you mean '{hint[0]}'?)" if hint else f" (known: {', '.join(known)})")
                )
        elif err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            problems.append(f"{_join('' if where == '<top level>' else where, missing)}: required key is missing")
        else:
            problems.append(f"{where}: {err.message}")
    return problems


# --------------------------------------------------------------------------- typed view


@dataclass(frozen=True)
class DatasetConfig:
    index: int
    path: str
    type: str  # normalised: jsonl | parquet | loadable
    output_dir: str
    output_format: str
    split: str | None
    image_base_path: str | None = None  # relative image paths start here (default: the dataset's folder)


@dataclass(frozen=True)
class InputVar:
    name: str
    key: str
    has_default: bool
    default: Any
    optional: bool = False  # the key may be missing from the first rows (no preflight data check)
    type: str = "text"  # text | image (mirageflow.prompts.images)
    max_side: int | None = None  # image inputs: longest side after canonicalisation
    max_pixels: int | None = None  # image inputs: None = images.DEFAULT_MAX_PIXELS
    max_bytes: int | None = None  # image inputs: None = images.DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class OutputVar:
    name: str
    processor: str
    prompt: str | None  # None: a conversation output without a last user turn
    system: str | None
    response_prefix: str
    is_json: bool
    schema: json_output.OutputSchema | None
    sampling_params: dict
    allow_empty_output: bool = False
    keep_reasoning: bool = False  # the reasoning becomes the variable <name>_reasoning
    conversation: str | None = None  # an input variable holding the chat messages sent (prompts.PromptBuilder)
    kind: str = "llm"  # llm | custom | filter (mirageflow.prompts.python_steps)
    predicate: str | None = None  # of a filter


@dataclass(frozen=True)
class ProcessorConfig:
    type: str
    backend: str
    server_args: dict
    sampling_params: dict
    chat_template_kwargs: dict
    apply_chat_template: bool
    torch_threads: int | None
    # sglang_server / openai backends (see the schema for each)
    base_url: str | None = None
    api_key_env: str | None = None
    model: str | None = None
    server_command: list[str] | None = None
    server_start_timeout: float = 900.0
    request_timeout: float = 600.0
    max_retries: int = 5
    native_n: bool | None = None  # n_samples: one request with n (None: where the backend has it)


@dataclass(frozen=True)
class ShardParams:
    checkpoint_rows: int
    checkpoint_seconds: float
    checkpoint_min_seconds: float
    max_error_rate: float
    min_rows_for_error_rate: int
    max_errors: int | None
    max_inflight: int | None
    lease_timeout_seconds: float
    gpu_sample_interval_seconds: float = 0.5


@dataclass(frozen=True)
class PipelineConfig:
    raw: dict = field(repr=False)  # the validated, expanded config with defaults filled in
    stats: bool
    state_dir: str
    num_shards: int
    batch_size: int
    datasets: list[DatasetConfig]
    processors: dict[str, ProcessorConfig]
    inputs: list[InputVar]
    outputs: list[OutputVar]
    remove_columns: bool
    output_schema: dict
    merge: bool
    shard: ShardParams
    retry_failed_rows: bool
    n_samples: int = 1  # records per input row (mirageflow/prompts/samples.py)
    preserve_columns: tuple[str, ...] = ()
    # processors of type custom (Python functions; no engine), by type
    custom_processors: dict[str, python_steps.CustomProcessor] = field(default_factory=dict)
    dedup: DedupParams | None = None  # deduplication_params when enabled (data/dedup.py)

    def shard_dir(self, shard_id: int) -> Path:
        return Path(self.state_dir) / f"shard_{shard_id}"


def load_config(
    source: Mapping | str | os.PathLike,
    *,
    environ: Mapping[str, str] | None = None,
    check_paths: bool = True,
) -> PipelineConfig:
    """Validate a config (a mapping, or a YAML file path) and return its typed view.

    Raises ConfigError listing every problem found, each prefixed with its key path.
    """
    label = None
    if not isinstance(source, Mapping):
        label = str(source)
        source = read_config_file(source)
    problems: list[str] = []
    cfg = expand_env(copy.deepcopy(dict(source)), os.environ if environ is None else environ, "", problems)
    cfg = coerce_scalars(cfg, schema(), schema())
    problems += _schema_problems(cfg, schema())
    if problems:
        raise ConfigError(problems, label)
    view = _build(cfg, problems, check_paths)
    if problems:
        raise ConfigError(problems, label)
    return view


def read_config_file(path: str | os.PathLike) -> dict:
    """The YAML mapping in a config file; ConfigError (naming the file) when it cannot be read."""
    label = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError([f"config file '{label}' does not exist (No such file or directory)"], label) from None
    except IsADirectoryError:
        raise ConfigError([f"'{label}' is a directory, not a config file"], label) from None
    except OSError as e:
        raise ConfigError([f"cannot read config file '{label}': {e.strerror or e}"], label) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            [f"config file '{label}' is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, line {line}); save it as UTF-8"],
            label,
        ) from None
    try:
        loaded = yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as e:
        raise ConfigError([f"cannot parse config file '{label}' as YAML: {e}"], label) from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, Mapping):
        raise ConfigError([f"config file '{label}' must hold a YAML mapping (it holds a {type(loaded).__name__})"], label)
    return dict(loaded)


def default_state_dir(output_dir: str) -> str:
    """The state_dir of a config without one: ``<first dataset's output_dir>/.mirageflow-state``.

    Per pipeline (an output_dir belongs to one pipeline, see pipeline_state's owner
    marker), the same for the driver, every job and ``mmirage status`` (no config file
    name needed), and hidden from readers of the output directory (pyarrow, datasets).
    """
    return os.path.join(output_dir, DEFAULT_STATE_SUBDIR)


DEFAULT_STATE_SUBDIR = ".mirageflow-state"
MAX_SHARDS = 1_000_000  # the schema's maximum of loading_params.num_shards


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it (real paths)."""
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def _unusable_dir(path: str) -> str | None:
    """Why the workflow could not create or write directory ``path``, or None (cheap: stats only)."""
    probe = os.path.abspath(path)
    while True:
        if os.path.exists(probe):
            break
        if os.path.lexists(probe):  # a dangling symlink
            return f"'{probe}' is a broken symbolic link"
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    if not os.path.isdir(probe):
        return f"'{probe}' is a file, not a directory" + ("" if probe == os.path.abspath(path) else f", so '{path}' cannot be created under it")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"'{probe}' is not writable" + ("" if probe == os.path.abspath(path) else f", so '{path}' cannot be created")
    return None


def _input_overlap(out_dir: str, ds: DatasetConfig) -> str | None:
    """Why ``out_dir`` may not be written for input dataset ``ds`` (equal to it, or inside it)."""
    path = ds.path
    if any(c in path for c in "*?[") and not os.path.exists(path):  # a Parquet glob
        base = path
        while any(c in base for c in "*?["):
            base = os.path.dirname(base)
        if "**" in path and _inside(out_dir, base or "."):
            return f"is inside the directory the recursive glob '{path}' reads: its own output would become input"
        return None
    if ds.type != "jsonl" and os.path.isdir(path) and _inside(out_dir, path):
        return f"is inside input dataset directory '{path}': its own output would become input"
    if os.path.exists(path) and os.path.realpath(out_dir) == os.path.realpath(path):
        return f"is the input file '{path}' itself"
    return None


def _dataset_problems(ds: dict, where: str) -> list[str]:
    path, kind = os.path.expanduser(ds["path"]), ds["type"].lower()
    if kind == "jsonl" and not os.path.isfile(path):
        return [f"{where}.path: JSONL file '{path}' does not exist"]
    if kind == "loadable" and not os.path.isdir(path):
        return [f"{where}.path: loadable dataset directory '{path}' does not exist"]
    if kind == "parquet" and not (os.path.isfile(path) or os.path.isdir(path) or glob.glob(path)):
        return [f"{where}.path: no Parquet file, directory or glob match at '{path}'"]
    return []


def _processor(p: dict) -> ProcessorConfig:
    sampling = dict(p["default_sampling_params"])
    kwargs = dict(p["chat_template_kwargs"])
    # MMIRAGE's location for chat-template switches has no effect in SGLang; honour it here.
    custom = sampling.pop("custom_params", None) or {}
    kwargs = {**custom.get("chat_template_kwargs", {}), **kwargs}
    return ProcessorConfig(
        type=p["type"],
        backend=p["backend"],
        server_args=p["server_args"],
        sampling_params=sampling,
        chat_template_kwargs=kwargs,
        apply_chat_template=p["apply_chat_template"],
        torch_threads=p["torch_threads"],
        base_url=p["base_url"],
        api_key_env=p["api_key_env"],
        model=p["model"],
        server_command=p["server_command"],
        server_start_timeout=p["server_start_timeout"],
        request_timeout=p["request_timeout"],
        max_retries=p["max_retries"],
        native_n=p["native_n"],
    )


def _conversation_problems(out: dict, where: str, input_names: list[str], known: list[str], processors: dict) -> list[str]:
    """An output's ``conversation``: an input variable, a processor that applies the chat
    template; without it the output needs a prompt."""
    name = out.get("conversation")
    if name is None:
        return [] if out.get("prompt") else [f"{where}.prompt: required key is missing (or set conversation to send a row's chat messages)"]
    problems = []
    if name not in input_names:
        why = "an output is text or a JSON object, not a list of messages" if name in known else "no such input"
        problems.append(f"{where}.conversation: '{name}' must name an input variable holding the chat messages ({why})" + prompts._hint(name, input_names))
    proc = processors.get(out["type"])
    if proc is not None and not proc.apply_chat_template:
        problems.append(f"{where}.conversation: needs processors[].apply_chat_template: true (a conversation is sent as chat messages)")
    return problems


_LLM_ONLY_OUTPUT_KEYS = (
    "prompt", "system", "conversation", "output_schema", "response_prefix", "sampling_params", "keep_reasoning", "allow_empty_output",
)  # fmt: skip


def _custom_processor(p: dict, i: int, custom: dict, problems: list[str], check_paths: bool) -> None:
    """A processor of type custom: its script and function (preflight imports it), into ``custom``."""
    where = f"processors[{i}]"
    if p["type"] != "custom":  # an llm processor without server_args
        problems.append(f"{where}.server_args: required key is missing (processors of type '{p['type']}' need a model)")
        return
    if p["type"] in custom:
        problems.append(f"{where}.type: a second 'custom' processor; outputs could not tell them apart")
    for key in ("script_path", "function_name"):
        if not p.get(key):
            problems.append(f"{where}.{key}: required key is missing (processors of type custom call a Python function)")
    if p.get("server_args"):
        problems.append(f"{where}.server_args: a custom processor runs no model")
    script = os.path.expanduser(p.get("script_path") or "")
    if check_paths and script and not os.path.isfile(script):
        problems.append(f"{where}.script_path: Python file '{script}' does not exist" + ("" if not os.path.isdir(script) else " (it is a directory)"))
    custom[p["type"]] = python_steps.CustomProcessor(
        p["type"], script, p.get("function_name") or "", p["max_workers"], p["start_method"], p["timeout_ms"],
        p["max_timeouts"], p["max_errors"], p["fallback_value"],
    )  # fmt: skip


def _python_step_output(out: dict, where: str, custom: dict, known: list[str], json_fields: dict, problems: list[str]) -> OutputVar:
    """An output of type filter or custom (mirageflow.prompts.python_steps); a custom one defines its variable."""
    kind = out["type"]
    for key in _LLM_ONLY_OUTPUT_KEYS:
        if out.get(key):
            problems.append(f"{where}.{key}: only LLM outputs have a {key} (this output's type is {kind})")
    if kind == "filter":
        if out.get("predicate") is None:
            problems.append(f"{where}.predicate: required key is missing (a filter keeps the rows where it is true, e.g. 'score > 33')")
        else:
            problems += python_steps.predicate_problems(out["predicate"], known, f"{where}.predicate", json_fields)
    else:
        if out.get("predicate") is not None:
            problems.append(f"{where}.predicate: only outputs of type filter have a predicate")
        if "custom" not in custom:
            problems.append(f"{where}.type: no 'custom' processor is defined in processors (type: custom, script_path, function_name)")
        if out["name"] in known:
            problems.append(f"{where}.name: duplicate variable '{out['name']}'")
        known.append(out["name"])
        json_fields.pop(out["name"], None)  # any value: its fields are not checked
    return OutputVar(out["name"], kind, None, None, "", False, None, {}, kind=kind, predicate=out.get("predicate"))


def _image_problems(cfg: dict, inputs: list[InputVar]) -> list[str]:
    """Image inputs need the chat template (it writes the model's image placeholders) and
    go into the user turn only. (A text-only model is preflight's check: it reads config.json.)"""
    images = [v.name for v in inputs if v.type == "image"]
    if not images:
        return []
    problems = []
    outputs = [o for o in cfg["processing_params"]["outputs"] if o.get("type", "llm") not in ("filter", "custom")]
    used = {o.get("type", "llm") for o in outputs}
    for i, p in enumerate(cfg["processors"]):
        if p["type"] in used and not p["apply_chat_template"]:
            problems.append(
                f"processors[{i}].apply_chat_template: false, but image inputs ({', '.join(images)}) need the chat "
                "template: it writes the model's image placeholder for each image inside the user turn"
            )
    for i, out in enumerate(cfg["processing_params"]["outputs"]):
        system = out.get("system")
        if isinstance(system, str):
            try:
                named = prompts.meta.find_undeclared_variables(prompts._ENV.parse(system))
            except Exception:  # noqa: BLE001 - a syntax error is reported by template_problems
                continue
            for name in sorted(named & set(images)):
                problems.append(f"processing_params.outputs[{i}].system: image input '{name}' can only be used in the prompt (the user turn)")
    return problems


def _build(cfg: dict, problems: list[str], check_paths: bool) -> PipelineConfig:
    lp, pp = cfg["loading_params"], cfg["processing_params"]

    processors: dict[str, ProcessorConfig] = {}
    custom: dict[str, python_steps.CustomProcessor] = {}
    for i, p in enumerate(cfg["processors"]):
        if p["type"] == "custom" or "server_args" not in p:
            _custom_processor(p, i, custom, problems, check_paths)
            continue
        if p.get("script_path") or p.get("function_name"):
            problems.append(f"processors[{i}]: script_path and function_name belong to processors of type custom, not '{p['type']}'")
        if p["type"] in processors:
            problems.append(f"processors[{i}].type: a second '{p['type']}' processor; outputs could not tell them apart")
        if p["chat_template"]:
            problems.append(f"processors[{i}].chat_template: named chat templates are not supported; the model's own template is used")
        if p["backend"] == "openai" and not p["base_url"]:
            problems.append(f"processors[{i}].base_url: required by backend openai (e.g. http://node:30000/v1)")
        if p["native_n"] and p["backend"] != "openai":
            problems.append(
                f"processors[{i}].native_n: only the openai backend sends one request with n; backend "
                f"'{p['backend']}' sends one request per sample (see the key's description)"
            )
        processors[p["type"]] = _processor(p)

    datasets = []
    for i, ds in enumerate(lp["datasets"]):
        where = f"loading_params.datasets[{i}]"
        if not ds["path"].strip():
            problems.append(f"{where}.path: empty (a ${{VAR}} that expands to nothing?)")
        elif check_paths:
            problems += _dataset_problems(ds, where)
        if not ds["output_dir"].strip():
            problems.append(
                f"{where}.output_dir: empty (a ${{VAR}} that expands to nothing?); outputs would be written to the working directory's root"
            )
        datasets.append(
            DatasetConfig(
                index=i,
                path=os.path.expanduser(ds["path"]),
                type=ds["type"].lower(),
                output_dir=os.path.expanduser(ds["output_dir"]),
                output_format=ds["output_format"],
                split=ds["split"],
                image_base_path=os.path.expanduser(ds["image_base_path"]) if ds.get("image_base_path") else None,
            )
        )
    out_dirs = [d.output_dir for d in datasets]
    for i, d in enumerate(out_dirs):
        if d in out_dirs[:i]:
            problems.append(f"loading_params.datasets[{i}].output_dir: '{d}' is already used by another dataset")

    state_dir = os.path.expanduser(lp["state_dir"]) if "state_dir" in lp else default_state_dir(datasets[0].output_dir)
    if not state_dir.strip():
        problems.append(
            "loading_params.state_dir: empty (a ${VAR} that expands to nothing?); the workflow's targets would be "
            "put at the filesystem root. Set a directory, or leave the key out for the default "
            f"<first output_dir>/{DEFAULT_STATE_SUBDIR}"
        )
    if check_paths:
        for i, d in enumerate(out_dirs):
            if not d.strip():
                continue
            why = _unusable_dir(d)
            if why:
                problems.append(f"loading_params.datasets[{i}].output_dir: {why}")
            for ds in datasets:
                if ds.path.strip():
                    why = _input_overlap(d, ds)
                    if why:
                        problems.append(f"loading_params.datasets[{i}].output_dir: '{d}' {why} (datasets[{ds.index}].path)")
        if state_dir.strip():
            why = _unusable_dir(state_dir)
            if why:
                problems.append(f"loading_params.state_dir: {why}")

    known: list[str] = []
    json_fields: dict[str, list[str]] = {}  # JSON outputs with declared fields: name -> fields
    inputs = []
    for i, var in enumerate(pp["inputs"]):
        where = f"processing_params.inputs[{i}]"
        if var["name"] in known:
            problems.append(f"{where}.name: duplicate variable '{var['name']}'")
        known.append(var["name"])
        try:
            prompts.compile_jmespath(var["key"])
        except ValueError as e:
            problems.append(f"{where}.key: {e}")
        inputs.append(
            InputVar(
                var["name"], var["key"], "default" in var, var.get("default"), bool(var.get("optional", False)),
                var["type"], var.get("max_side"), var.get("max_pixels"), var.get("max_bytes"),
            )
        )
        if var["type"] != "image":
            for key in ("max_side", "max_pixels", "max_bytes"):
                if key in var:
                    problems.append(f"{where}.{key}: only image inputs have {key} (type is '{var['type']}')")

    outputs = []
    for i, out in enumerate(pp["outputs"]):
        where = f"processing_params.outputs[{i}]"
        if out["type"] in ("filter", "custom"):
            outputs.append(_python_step_output(out, where, custom, known, json_fields, problems))
            continue
        if out.get("predicate") is not None:
            problems.append(f"{where}.predicate: only outputs of type filter have a predicate")
        if out["name"] in known:
            problems.append(f"{where}.name: duplicate variable '{out['name']}'")
        if out["type"] not in processors:
            problems.append(f"{where}.type: no '{out['type']}' processor is defined in processors")
        for key in ("prompt", "system"):
            if out.get(key):
                problems += prompts.template_problems(out[key], known, f"{where}.{key}", json_fields)
        problems += _conversation_problems(out, where, [v.name for v in inputs], known, processors)
        is_json = out["output_type"].lower() == "json"
        schema = None
        if "output_schema" in out:
            if not is_json:
                problems.append(f"{where}.output_schema: only JSON outputs have an output_schema (output_type is '{out['output_type']}')")
            else:
                try:
                    schema = json_output.OutputSchema.parse(out["output_schema"], f"{where}.output_schema")
                except json_output.SchemaError as e:
                    problems += e.problems
        elif is_json:
            schema = json_output.OutputSchema.parse([], f"{where}.output_schema")
        known.append(out["name"])
        if out.get("keep_reasoning"):
            reasoning_name = f"{out['name']}_reasoning"
            if reasoning_name in known:
                problems.append(f"{where}.keep_reasoning: variable '{reasoning_name}' is already defined")
            known.append(reasoning_name)
            json_fields.pop(reasoning_name, None)
        json_fields.pop(out["name"], None)
        if schema is not None and schema.fields:
            json_fields[out["name"]] = [f.name for f in schema.fields]
        outputs.append(
            OutputVar(
                out["name"], out["type"], out["prompt"], out["system"], out["response_prefix"], is_json, schema,
                out["sampling_params"], out["allow_empty_output"], bool(out.get("keep_reasoning", False)),
                conversation=out.get("conversation"),
            )
        )

    problems += prompts.record_template_problems(pp["output_schema"], known, "processing_params.output_schema", json_fields)
    problems += _image_problems(cfg, inputs)
    problems += _sample_problems(pp, processors, outputs)
    problems += cluster.execution_problems(cfg["execution_params"])
    if cfg["execution_params"].get("shards_per_engine", 1) > 1 and all(processors[o.processor].backend == "openai" for o in outputs if o.processor in processors):
        problems.append(
            "execution_params.shards_per_engine: shared engines serve processors that load a model; every processor "
            "of this pipeline's outputs uses backend openai (a remote server, nothing to load): set it to 1"
        )
    problems += _dedup_problems(cfg, outputs)

    return PipelineConfig(
        raw=cfg,
        stats=cfg["stats"],
        state_dir=state_dir,
        num_shards=lp["num_shards"],
        batch_size=lp["batch_size"],
        datasets=datasets,
        processors=processors,
        inputs=inputs,
        outputs=outputs,
        remove_columns=pp["remove_columns"],
        output_schema=pp["output_schema"],
        merge=cfg["execution_params"]["merge"],
        shard=ShardParams(**cfg["shard_params"]),
        retry_failed_rows=cfg["retry_failed_rows"],
        custom_processors=custom,
        n_samples=pp["n_samples"],
        preserve_columns=tuple(pp["preserve_columns"]),
        dedup=DedupParams.from_raw(cfg["deduplication_params"]) if cfg["deduplication_params"]["enabled"] else None,
    )


def _dedup_problems(cfg: dict, outputs: list) -> list[str]:
    """deduplication_params mistakes the schema cannot see: no merge to read, no text field."""
    dp, pp = cfg["deduplication_params"], cfg["processing_params"]
    if not dp["enabled"]:
        return []
    where = "deduplication_params"
    problems = []
    if not cfg["execution_params"]["merge"]:
        problems.append(f"{where}.enabled: needs execution_params.merge: true (deduplication reads <output_dir>/merged/)")
    if not (dp["exact"] or dp["fuzzy"]):
        problems.append(f"{where}: exact and fuzzy are both false, so nothing would be removed; set one, or enabled: false")
    field_ = dp["text_field"]
    if not field_:
        problems.append(f"{where}.text_field: required when enabled (the record field whose text is compared)")
        return problems
    produced = produced_fields(pp, outputs)
    # with remove_columns false a source column may be meant: preflight looks at the first rows
    if field_ not in produced and pp["remove_columns"]:
        problems.append(
            f"{where}.text_field: '{field_}' is not a field of the records (remove_columns is true; "
            f"fields: {', '.join(produced) or 'none'})" + prompts._hint(field_, produced)
        )
    return problems


def _sample_problems(pp: dict, processors: dict, outputs: list) -> list[str]:
    """n_samples and preserve_columns mistakes (the schema checked their types)."""
    problems = []
    shaped = pp["output_schema"] if isinstance(pp["output_schema"], Mapping) else {}
    for name in pp["preserve_columns"]:
        if name in ("source_index", "sample_index"):
            problems.append(f"processing_params.preserve_columns: '{name}' is set by the workflow on every record")
        elif name in shaped:
            problems.append(f"processing_params.preserve_columns: '{name}' is also a field of processing_params.output_schema")
    n = pp["n_samples"]
    llm_outputs = [o for o in outputs if o.kind == "llm"]  # filter and custom steps sample nothing
    if n > 1 and llm_outputs:
        greedy = [
            o.name for o in llm_outputs
            if o.processor in processors
            and {**processors[o.processor].sampling_params, **o.sampling_params}.get("temperature", 1.0) == 0
        ]  # fmt: skip
        if len(greedy) == len(llm_outputs):
            problems.append(
                f"processing_params.n_samples: {n} samples per row, but every output decodes greedily "
                f"(temperature 0: {', '.join(greedy)}), so the samples would be identical; set a temperature > 0"
            )
    return problems


# --------------------------------------------------------------------------- records identity

RECORDS_IDENTITY_VERSION = 1
# How the workflow reaches or runs an engine, not what it generates: an edit here reruns nothing.
_PROCESSOR_OPERATIONAL_KEYS = (
    "base_url", "api_key_env", "server_start_timeout", "request_timeout", "max_retries", "torch_threads",
    # one request with n or n requests: the same draw on servers that seed choice i with seed + i
    "native_n",
    # custom processors' (python_steps): how the function is run, or accepted and unused
    "max_workers", "start_method", "timeout_ms", "max_timeouts", "max_errors", "fallback_value",
)  # fmt: skip


def records_identity(cfg: PipelineConfig) -> dict:
    """The part of a validated config that can change a shard's records (JSON-able, ordered).

    Processors (backend, model, server args, sampling, chat template settings; not how the
    engine is reached or waited for: base_url, api_key_env, timeouts, retries, torch
    threads), processing_params (inputs, outputs with their prompts and schemas,
    output_schema, remove_columns) and each dataset's path, type, split, output format and
    output directory. Comments, execution_params, shard_params, stats, retry_failed_rows
    and the state_dir are not part of it. The workflow reruns shards when its hash changes
    (``<state_dir>/records.fingerprint``, see mirageflow.state.pipeline).
    """
    raw = cfg.raw
    identity = {
        "version": RECORDS_IDENTITY_VERSION,
        "processors": [
            {k: v for k, v in p.items() if k not in _PROCESSOR_OPERATIONAL_KEYS} for p in raw["processors"]
        ],
        # n_samples/preserve_columns at their defaults leave the identity as before they existed
        "processing_params": {
            k: v for k, v in raw["processing_params"].items()
            if not (k == "n_samples" and v == 1 or k == "preserve_columns" and not v)
        },
        "datasets": [
            {"path": d.path, "type": d.type, "split": d.split, "output_format": d.output_format, "output_dir": d.output_dir}
            # only when set: configs without images keep their fingerprint
            | ({"image_base_path": d.image_base_path} if d.image_base_path else {})
            for d in cfg.datasets
        ],
    }
    if cfg.custom_processors:  # an edited script changes the records (a config without one: no key)
        identity["scripts"] = {p.script_path: _file_sha256(p.script_path) for p in cfg.custom_processors.values()}
    return identity


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:  # load_config reported it
        return None
