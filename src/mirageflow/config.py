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
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

from mirageflow import cluster, json_output, prompts


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
    with resources.files("mirageflow").joinpath("config.schema.yaml").open(encoding="utf-8") as f:
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


@dataclass(frozen=True)
class InputVar:
    name: str
    key: str
    has_default: bool
    default: Any
    optional: bool = False  # the key may be missing from the first rows (no preflight data check)


@dataclass(frozen=True)
class OutputVar:
    name: str
    processor: str
    prompt: str
    system: str | None
    response_prefix: str
    is_json: bool
    schema: json_output.OutputSchema | None
    sampling_params: dict
    allow_empty_output: bool = False
    keep_reasoning: bool = False  # the reasoning becomes the variable <name>_reasoning


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
    )


def _build(cfg: dict, problems: list[str], check_paths: bool) -> PipelineConfig:
    lp, pp = cfg["loading_params"], cfg["processing_params"]

    processors: dict[str, ProcessorConfig] = {}
    for i, p in enumerate(cfg["processors"]):
        if p["type"] in processors:
            problems.append(f"processors[{i}].type: a second '{p['type']}' processor; outputs could not tell them apart")
        if p["chat_template"]:
            problems.append(f"processors[{i}].chat_template: named chat templates are not supported; the model's own template is used")
        if p["backend"] == "openai" and not p["base_url"]:
            problems.append(f"processors[{i}].base_url: required by backend openai (e.g. http://node:30000/v1)")
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
        if ds.get("image_base_path"):
            problems.append(f"loading_params.datasets[{i}].image_base_path: image inputs are not supported yet")
        datasets.append(
            DatasetConfig(
                index=i,
                path=os.path.expanduser(ds["path"]),
                type=ds["type"].lower(),
                output_dir=os.path.expanduser(ds["output_dir"]),
                output_format=ds["output_format"],
                split=ds["split"],
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
        inputs.append(InputVar(var["name"], var["key"], "default" in var, var.get("default"), bool(var.get("optional", False))))

    outputs = []
    for i, out in enumerate(pp["outputs"]):
        where = f"processing_params.outputs[{i}]"
        if out["name"] in known:
            problems.append(f"{where}.name: duplicate variable '{out['name']}'")
        if out["type"] not in processors:
            problems.append(f"{where}.type: no '{out['type']}' processor is defined in processors")
        for key in ("prompt", "system"):
            if out.get(key):
                problems += prompts.template_problems(out[key], known, f"{where}.{key}", json_fields)
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
            )
        )

    problems += prompts.record_template_problems(pp["output_schema"], known, "processing_params.output_schema", json_fields)
    problems += cluster.execution_problems(cfg["execution_params"])

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
    )


# --------------------------------------------------------------------------- records identity

RECORDS_IDENTITY_VERSION = 1
# How the workflow reaches or runs an engine, not what it generates: an edit here reruns nothing.
_PROCESSOR_OPERATIONAL_KEYS = (
    "base_url", "api_key_env", "server_start_timeout", "request_timeout", "max_retries", "torch_threads",
)  # fmt: skip


def records_identity(cfg: PipelineConfig) -> dict:
    """The part of a validated config that can change a shard's records (JSON-able, ordered).

    Processors (backend, model, server args, sampling, chat template settings; not how the
    engine is reached or waited for: base_url, api_key_env, timeouts, retries, torch
    threads), processing_params (inputs, outputs with their prompts and schemas,
    output_schema, remove_columns) and each dataset's path, type, split, output format and
    output directory. Comments, execution_params, shard_params, stats, retry_failed_rows
    and the state_dir are not part of it. The workflow reruns shards when its hash changes
    (``<state_dir>/records.fingerprint``, see mirageflow.pipeline_state).
    """
    raw = cfg.raw
    return {
        "version": RECORDS_IDENTITY_VERSION,
        "processors": [
            {k: v for k, v in p.items() if k not in _PROCESSOR_OPERATIONAL_KEYS} for p in raw["processors"]
        ],
        "processing_params": raw["processing_params"],
        "datasets": [
            {"path": d.path, "type": d.type, "split": d.split, "output_format": d.output_format, "output_dir": d.output_dir}
            for d in cfg.datasets
        ],
    }
