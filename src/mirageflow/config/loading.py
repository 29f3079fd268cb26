"""Pipeline config: environment expansion, schema validation with defaults, semantic checks.

The schema (workflow/schemas/config.schema.yaml, shipped in the package as
config.schema.yaml) owns keys, types, defaults and descriptions; config/build.py makes the
typed view (config/types.py) section by section with the checks a schema cannot express
(template variables, output schemas, paths); this module reads the file, expands the
environment, validates against the schema and turns every problem into one error that
names each offending key path.
"""

from __future__ import annotations

import copy
import functools
import difflib
import hashlib
import os
import re
from importlib import resources
from typing import Any, Mapping

import jsonschema
import yaml

from mirageflow.config.build import build
from mirageflow.files import open_regular
from mirageflow.config.types import PipelineConfig
from mirageflow.errors import InputError


class ConfigError(InputError, ValueError):
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
    r"processing_params\.output_schema|processing_params\.outputs\[\d+\]\.(prompt|system|response_prefix|negative_prompt|filename_template)"
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
        return {k: v if not_expanded(_join(path, k)) else expand_env(v, environ, _join(path, k), problems) for k, v in value.items()}
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
    problems += nul_problems(cfg)
    if problems:
        raise ConfigError(problems, label)
    view, problems = build(cfg, check_paths)
    if problems:
        raise ConfigError(problems, label)
    return view


def nul_problems(value: Any, path: str = "") -> list[str]:
    """Strings holding a NUL byte outside the templates: no path, name or URL can hold one
    (the operating system refuses it), so each is named here instead of failing later."""
    if path == "processing_params":  # prompts and record templates are text for the model
        return []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nul_problems(v, _join(path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nul_problems(v, f"{path}[{i}]")]
    if isinstance(value, str) and "\0" in value:
        return [f"{path or '<top level>'}: holds a NUL byte (\\0), which no path, name or URL can hold: {value!r}"[:300]]
    return []


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


# --------------------------------------------------------------------------- records identity

RECORDS_IDENTITY_VERSION = 1
# How the workflow reaches or runs an engine, not what it generates: an edit here reruns nothing.
_PROCESSOR_OPERATIONAL_KEYS = (
    "base_url", "api_key_env", "server_start_timeout", "request_timeout", "max_retries", "torch_threads",
    # a launched server's environment (VLLM_CPU_KVCACHE_SPACE, LD_PRELOAD): where and how fast it runs
    "server_env",
    # a launched server restarted in the job when it dies or freezes: the same answers
    "max_restarts", "hang_seconds",
    # one request with n or n requests: the same draw on servers that seed choice i with seed + i
    "native_n",
    # custom processors' (shard/steps/python.py): how the function is run, or accepted and unused
    "max_workers", "start_method", "timeout_ms", "max_timeouts", "max_errors", "fallback_value",
    # batch_api: how requests are grouped into batches, waited for and recorded (engines/batch_api.py)
    "max_chunk_bytes", "max_requests_per_chunk", "metadata_output_path", "oversized_request_policy", "retry_policy",
    "metadata", "timeout_seconds", "poll_seconds", "poll_max_seconds",
    # image_gen: how images are requested (the images are the same)
    "parallel_inference", "parallel_chunk_size",
    # api_llm (MMIRAGE): how many requests at once, and the wait between retries
    "max_concurrency", "retry_base_delay",
    # backend openai's pace under a provider's limits (transport/rate_limit.py)
    "max_requests_per_minute", "max_tokens_per_minute",
    # what the tokens cost (stats/pricing.py): the same answers at any price
    "pricing",
)  # fmt: skip


def records_identity(cfg: PipelineConfig) -> dict:
    """The part of a validated config that can change a shard's records (JSON-able, ordered).

    Processors (backend, model, server args, sampling, chat template settings; not how the
    engine is reached or waited for: base_url, api_key_env, timeouts, retries, torch
    threads), processing_params (inputs, outputs with their prompts and schemas,
    output_schema, remove_columns) and each dataset's path, type, split, output format, shard boundaries and
    output directory. Comments, execution_params, shard_params, stats, retry_failed_rows
    and the state_dir are not part of it. The workflow reruns shards when its hash changes
    (``<state_dir>/records.fingerprint``, see mirageflow.state.pipeline).
    """
    raw = cfg.raw
    identity = {
        "version": RECORDS_IDENTITY_VERSION,
        "processors": [{k: v for k, v in p.items() if k not in _PROCESSOR_OPERATIONAL_KEYS} for p in raw["processors"]],
        # n_samples/preserve_columns at their defaults leave the identity as before they existed
        "processing_params": {
            k: v for k, v in raw["processing_params"].items() if not (k == "n_samples" and v == 1 or k == "preserve_columns" and not v)
        },
        "datasets": [
            {"path": d.path, "type": d.type, "split": d.split, "output_format": d.output_format, "output_dir": d.output_dir}
            # only when set: configs without images keep their fingerprint
            | ({"image_base_path": d.image_base_path} if d.image_base_path else {})
            | ({"allow_images_outside_base": True} if d.allow_images_outside_base else {})
            | ({"shard_boundaries": d.shard_boundaries} if d.shard_boundaries != "rows" else {})  # which rows a shard holds
            for d in cfg.datasets
        ],
    }
    if cfg.custom_processors:  # an edited script changes the records (a config without one: no key)
        identity["scripts"] = {p.script_path: _file_sha256(p.script_path) for p in cfg.custom_processors.values()}
    return identity


def processor_identity(cfg: PipelineConfig, name: str) -> dict:
    """What of processor ``name`` (its type) determines an answer besides the request: its
    records-identity entry without the default sampling (requests carry their sampling).
    Part of the request cache's keys (shard/request_cache.py)."""
    for p in cfg.raw["processors"]:
        if p["type"] == name:
            return {k: v for k, v in p.items() if k not in _PROCESSOR_OPERATIONAL_KEYS and k != "default_sampling_params"}
    raise KeyError(name)


def _file_sha256(path: str) -> str | None:
    try:
        with open_regular(path) as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, ValueError):  # load_config reported it
        return None
