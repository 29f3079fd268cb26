"""The typed view of a schema-valid config, section by section, with the checks a schema cannot express.

``build`` turns the validated mapping (defaults filled in) into a ``PipelineConfig`` and
every problem found, each ``key.path: message``; load_config (config/loading.py) raises
them all at once. Each section has a builder that returns its value and its own problems;
a section that needs another gets that one's built value (outputs get the processors and
the variables defined before them). A new key is read in its section's builder; a new
processor type is one entry of ``PROCESSOR_TYPES``, a new output type one of ``OUTPUT_TYPES``.
What a backend can do (a base_url it needs, native n, a model it loads) is the engine
registry's to say (engines/registry.py), never a backend name compared here.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from mirageflow.cluster import resources as cluster
from mirageflow.cluster.node_span import node_span_problems
from mirageflow.config.types import (
    BATCH_LIMITS,
    DEFAULT_MAX_RETRIES,
    IGNORED_MMIRAGE_KEYS,
    BatchSettings,
    CustomProcessor,
    DatasetConfig,
    DedupParams,
    ApiOptions,
    ExecutionParams,
    LaunchedServer,
    PublishParams,
    ImageGenProcessor,
    ImageOutput,
    InputVar,
    OutputVar,
    PipelineConfig,
    ProcessorConfig,
    ServerArgs,
    ShardParams,
)
from mirageflow.data.dedup import produced_fields
from mirageflow.files import path_hint, regular_file_problem
from mirageflow.engines import registry
from mirageflow.prompts import json_output
from mirageflow.prompts import templates as prompts

DEFAULT_STATE_SUBDIR = ".mirageflow-state"


def build(cfg: dict, check_paths: bool) -> tuple[PipelineConfig, list[str]]:
    """The typed config and its problems (none: the config is valid), in the order of its sections."""
    lp, pp = cfg["loading_params"], cfg["processing_params"]
    processors, custom, images, problems = _processors(cfg["processors"], check_paths)
    datasets, found = _datasets(lp["datasets"], check_paths)
    problems += found
    state_dir, found = _state_dir(lp, datasets)
    problems += found
    if check_paths:
        problems += _path_problems(datasets, state_dir)
    inputs, found = _inputs(pp["inputs"])
    problems += found
    outputs, variables, found = _outputs(pp["outputs"], _Scope(processors, custom, inputs, images))
    problems += found
    # source_index: built in (the row's index; prompts.RecordRenderer), unless a variable has the name
    names = variables.names if BUILTIN_INDEX in variables.names else [*variables.names, BUILTIN_INDEX]
    problems += prompts.record_template_problems(pp["output_schema"], names, "processing_params.output_schema", variables.json_fields)
    problems += reserved_name_problems(pp)
    problems += _image_problems(cfg, inputs)
    problems += _sample_problems(pp, processors, outputs)
    execution, found = _execution(cfg["execution_params"], processors, outputs)
    problems += found
    if execution.nodes > 1:  # their engines span the job's nodes (checked by _execution)
        processors = {name: dataclasses.replace(p, nodes=execution.nodes) for name, p in processors.items()}
    dedup, found = _dedup(cfg, outputs)
    problems += found
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
        merge=execution.merge,
        shard=ShardParams(**cfg["shard_params"]),
        retry_failed_rows=cfg["retry_failed_rows"],
        custom_processors=custom,
        image_processors=images,
        n_samples=pp["n_samples"],
        preserve_columns=tuple(pp["preserve_columns"]),
        dedup=dedup,
        execution=execution,
        warnings=tuple(_chat_template_warnings(cfg) + _unread_option_warnings(cfg)),
        fresh_answers=cfg["fresh_answers"],
    ), problems


BUILTIN_INDEX = "source_index"  # a variable of output_schema: the row's index in its dataset (RecordRenderer)


def _chat_template_warnings(cfg: dict) -> list[str]:
    """MMIRAGE's chat_template picks the image placeholder token there; here it changes nothing (said, not refused)."""
    images = any(v["type"] == "image" for v in cfg["processing_params"]["inputs"])
    return [
        f"processors[{i}].chat_template: '{p['chat_template']}' changes nothing here: in MMIRAGE it only picks the image "
        "placeholder token; here the model's own chat template writes one placeholder per image in the user turn"
        + ("" if images else " (and this pipeline has no image inputs)")
        for i, p in enumerate(cfg["processors"])
        if p.get("chat_template")
    ]


# --------------------------------------------------------------------------- processors


def _processors(entries: list[dict], check_paths: bool):
    """processors[]: the model processors (llm, batch_api), the custom (Python function) and
    the image_gen ones, by type."""
    processors: dict[str, ProcessorConfig] = {}
    custom: dict[str, CustomProcessor] = {}
    images: dict[str, ImageGenProcessor] = {}
    problems: list[str] = []
    for i, p in enumerate(entries):
        make = PROCESSOR_TYPES.get(p["type"], _model_processor)
        proc, found = make(p, i, {*processors, *custom, *images}, check_paths)
        problems += found
        if isinstance(proc, CustomProcessor):
            custom[proc.type] = proc
        elif isinstance(proc, ImageGenProcessor):
            images[proc.type] = proc
        elif proc is not None:
            processors[proc.type] = proc
    return processors, custom, images, problems


# Keys of processors of one type only (the schema keeps them all in one closed mapping).
_BATCH_KEYS = (
    "provider", "max_chunk_bytes", "max_requests_per_chunk", "metadata_output_path", "completion_window", "batch_endpoint",
    "oversized_request_policy", "retry_policy", "metadata", "max_tokens", "temperature", "top_p", "timeout_seconds",
    "poll_seconds", "poll_max_seconds",
)  # fmt: skip
_IMAGE_KEYS = ("external", "sglang", "pipeline_args", "parallel_inference", "parallel_chunk_size", "output_dir", "file_format")
_IMAGE_PARAMS = ("num_inference_steps", "guidance_scale", "negative_prompt", "width", "height")
# image_gen's backends (besides the registry's, which run language models; "sglang" there is
# SGLang's diffusion server): the schema's processors[].backend enum holds both
IMAGE_BACKENDS = ("external", "diffusers", "sglang")
_IMAGE_ONLY_BACKENDS = ("external", "diffusers")
# What differs between the batch providers: whether a request can continue a last assistant
# message (a response_prefix), whether temperature and top_p exclude each other (Anthropic's
# models take one), and the keys only the other provider has.
BATCH_PROVIDER_FACTS = {
    "openai": {"prefill": False, "one_sampler": False, "foreign": ()},
    "anthropic": {"prefill": True, "one_sampler": True, "foreign": ("completion_window", "batch_endpoint", "metadata")},
}


def _foreign_keys(p: dict, where: str, keys: tuple[str, ...], owner: str) -> list[str]:
    """Keys set on this processor that belong to processors of type ``owner``."""
    return [f"{where}.{key}: only {owner} processors have {key} (this one is of type {p['type']})" for key in keys if key in p]


def _rate_limit_problems(p: dict, where: str, what: str) -> list[str]:
    """max_requests/tokens_per_minute set on a processor that nothing paces by them."""
    return [
        f"{where}.{key}: only backend openai (and type api_llm) paces its requests by it (this processor's {what})"
        for key in RATE_LIMIT_KEYS if p.get(key) is not None
    ]  # fmt: skip


def _unpriced_problems(p: dict, where: str) -> list[str]:
    """pricing set on a processor whose work is not priced (stats/pricing.py prices tokens and GPU-hours)."""
    if p.get("pricing") is None:
        return []
    return [f"{where}.pricing: only model processors (llm, api_llm, batch_api) are priced (this one is of type {p['type']})"]


def _model_processor(p: dict, i: int, taken: set[str], check_paths: bool) -> tuple[ProcessorConfig | None, list[str]]:
    """A processor that runs a model (type llm): its engine's settings."""
    where = f"processors[{i}]"
    if "server_args" not in p:
        return None, [f"{where}.server_args: required key is missing (processors of type '{p['type']}' need a model)"]
    problems = _foreign_keys(p, where, _BATCH_KEYS, "batch_api") + _foreign_keys(p, where, _IMAGE_KEYS, "image_gen")
    problems += [
        f"{where}.default_sampling_params.{key}: an image generation parameter; only image_gen processors take it"
        for key in _IMAGE_PARAMS if key in p["default_sampling_params"]
    ]  # fmt: skip
    if p["backend"] in _IMAGE_ONLY_BACKENDS:
        problems.append(
            f"{where}.backend: '{p['backend']}' is an image_gen backend; a language model runs on auto, transformers, sglang, sglang_server or openai"
        )
    if p.get("script_path") or p.get("function_name"):
        problems.append(f"{where}: script_path and function_name belong to processors of type custom, not '{p['type']}'")
    if p["type"] in taken:
        problems.append(f"{where}.type: a second '{p['type']}' processor; outputs could not tell them apart")
    can = registry.capabilities(p["backend"])
    if can.needs_base_url and not p["base_url"]:
        problems.append(f"{where}.base_url: required by backend {p['backend']} (e.g. http://node:30000/v1)")
    if p["native_n"] and not can.native_n:
        able = registry.backends_that(lambda c: c.native_n)
        problems.append(
            f"{where}.native_n: only the {_listed(able, 'and')} backend{'s send' if len(able) > 1 else ' sends'} one request "
            f"with n; backend '{p['backend']}' sends one request per sample (see the key's description)"
        )
    if p["backend"] not in API_OPTION_BACKENDS:
        problems += _rate_limit_problems(p, where, f"backend is {p['backend']}")
    sampling = _max_tokens(dict(p["default_sampling_params"]), f"{where}.default_sampling_params", p["backend"], problems)
    kwargs = dict(p["chat_template_kwargs"])
    # MMIRAGE's location for chat-template switches has no effect in SGLang; honour it here.
    moved = sampling.pop("custom_params", None) or {}
    kwargs = {**moved.get("chat_template_kwargs", {}), **kwargs}
    return ProcessorConfig(
        type=p["type"],
        backend=p["backend"],
        server_args=ServerArgs(**p["server_args"]),
        sampling_params=sampling,
        chat_template_kwargs=kwargs,
        apply_chat_template=p["apply_chat_template"],
        torch_threads=p["torch_threads"],
        base_url=p["base_url"],
        api_key_env=p["api_key_env"],
        model=p["model"],
        request_timeout=p["request_timeout"],
        max_retries=p["max_retries"] if p["max_retries"] is not None else DEFAULT_MAX_RETRIES,
        native_n=p["native_n"],
        index=i,
        max_restarts=p["max_restarts"],
        hang_seconds=p["hang_seconds"],
        launch=_launch_options(p),
        api=_api_options(p),
        pricing=p.get("pricing"),
    ), problems


def _max_tokens(params: dict, where: str, backend: str | None, problems: list[str]) -> dict:
    """OpenAI's max_tokens (MMIRAGE's api_llm): max_new_tokens where the server speaks the OpenAI API; SGLang
    rejects it, so do we."""
    if "max_tokens" not in params:
        return params
    if backend is None or not registry.capabilities(backend).templates_server_side:  # not an OpenAI-compatible server
        problems.append(
            f"{where}.max_tokens: not a sampling parameter of this engine (SGLang rejects it; it is the OpenAI API's "
            "name, for processors of type api_llm or backend openai): use max_new_tokens"
        )
        return params
    if "max_new_tokens" in params:
        problems.append(f"{where}.max_tokens: and max_new_tokens both set (the same limit): keep one")
        return params
    return {("max_new_tokens" if k == "max_tokens" else k): v for k, v in params.items()}


RATE_LIMIT_KEYS = ("max_requests_per_minute", "max_tokens_per_minute")  # backend openai's pace

API_LLM_BACKEND = "openai"  # the engine that runs MMIRAGE's api_llm processors (an OpenAI-compatible server)
API_LLM_DEFAULTS = {  # MMIRAGE's api_llm (core/process/processors/api_llm/config.py)
    "base_url": "https://api.openai.com/v1", "api_key_env": "OPENAI_API_KEY", "max_concurrency": 8, "max_retries": 3,
    "retry_base_delay": 1.0,
}  # fmt: skip


# ProcessorConfig's option groups (config/types.py): the flat processors[] keys each group holds (key -> field) and
# the backends that have it; a model processor of another backend has None there.
LAUNCH_KEYS = {"server_command": "command", "server_env": "env", "server_start_timeout": "start_timeout"}
API_KEYS = ("max_concurrency", "retry_base_delay", *RATE_LIMIT_KEYS)
# the backends paced by the api group (auto: the vllm_server it may pick is fed through the openai backend)
API_OPTION_BACKENDS = (API_LLM_BACKEND, registry.AUTO)


def _launch_options(p: dict) -> LaunchedServer | None:
    """The launched server's options, for a backend that launches one (auto: where it may pick one)."""
    if not registry.launches_server(p["backend"]):
        return None
    return LaunchedServer(**{name: p[key] for key, name in LAUNCH_KEYS.items()})


def _api_options(p: dict) -> ApiOptions | None:
    """An OpenAI-compatible endpoint's concurrency and pace (the schema gives these keys no default: None)."""
    return ApiOptions(**{key: p.get(key) for key in API_KEYS}) if p["backend"] in API_OPTION_BACKENDS else None


def _unread_option_warnings(cfg: dict) -> list[str]:
    """A group's key set on a model processor whose backend has no such group: it changes nothing there (said, not
    refused, as before the groups; the rate limits are refused, _rate_limit_problems). The keys with a schema default
    are left out: their default is always there."""
    found = []
    for i, p in enumerate(cfg["processors"]):
        if p["type"] not in ("llm", "api_llm") or p["backend"] not in registry.config_backends():
            continue
        backend = API_LLM_BACKEND if p["type"] == "api_llm" and p["backend"] == registry.AUTO else p["backend"]
        if not registry.launches_server(backend):
            launching = _listed(registry.backends_that_launch(), "and")
            found += [
                f"processors[{i}].{key}: changes nothing for backend {backend} (only {launching} launch a server)"
                for key in ("server_command", "server_env") if p.get(key) is not None
            ]  # fmt: skip
        if backend not in API_OPTION_BACKENDS:
            found += [
                f"processors[{i}].{key}: changes nothing for backend {backend} (only backend {API_LLM_BACKEND} and type api_llm read it)"
                for key in ("max_concurrency", "retry_base_delay") if p.get(key) is not None
            ]  # fmt: skip
    return found


def _api_llm_processor(p: dict, i: int, taken: set[str], check_paths: bool) -> tuple[ProcessorConfig, list[str]]:
    """MMIRAGE's api_llm processor: an OpenAI-compatible endpoint, run by our backend openai with MMIRAGE's defaults."""
    where = f"processors[{i}]"
    problems = []
    backend = API_LLM_BACKEND if p["backend"] == registry.AUTO else p["backend"]
    if registry.capabilities(backend).loads_model:
        problems.append(
            f"{where}.backend: an api_llm processor is an OpenAI-compatible endpoint (backend {API_LLM_BACKEND}), not '{backend}'"
        )
    if not p.get("model"):
        problems.append(f"{where}.model: required by type api_llm (the model name the endpoint serves, e.g. gpt-4o-mini)")
    for key in ("server_args", "script_path", "function_name", "server_command"):
        if p.get(key):
            problems.append(f"{where}.{key}: an api_llm processor has no {key} (its model is `model`, served at base_url)")
    value = {k: p[k] if p.get(k) is not None else default for k, default in API_LLM_DEFAULTS.items()}
    as_openai = {**p, **value, "backend": backend, "server_args": {"model_path": p.get("model") or ""}}
    proc, found = _model_processor(as_openai, i, taken, check_paths)
    return proc, problems + found


def _custom_processor(p: dict, i: int, taken: set[str], check_paths: bool) -> tuple[CustomProcessor, list[str]]:
    """A processor of type custom: its script and function (preflight imports it)."""
    where = f"processors[{i}]"
    problems = _rate_limit_problems(p, where, "type is custom") + _unpriced_problems(p, where)
    if p["type"] in taken:
        problems.append(f"{where}.type: a second 'custom' processor; outputs could not tell them apart")
    for key in ("script_path", "function_name"):
        if not p.get(key):
            problems.append(f"{where}.{key}: required key is missing (processors of type custom call a Python function)")
    if p.get("server_args"):
        problems.append(f"{where}.server_args: a custom processor runs no model")
    script = os.path.expanduser(p.get("script_path") or "")
    why = regular_file_problem(script) if check_paths and script else None
    if why:  # a FIFO is named, never opened
        problems.append(f"{where}.script_path: Python file '{script}' {why}")
    return CustomProcessor(
        p["type"], script, p.get("function_name") or "", p["max_workers"], p["start_method"], p["timeout_ms"],
        fallback_value=p["fallback_value"], index=i,
    ), problems  # fmt: skip


BATCH_DEFAULT_MODEL = {"openai": "gpt-4.1-mini", "anthropic": "claude-haiku-4-5"}  # MMIRAGE's
BATCH_DEFAULT_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
DEFAULT_MAX_CHUNK_BYTES = 50 * 1024 * 1024  # MMIRAGE's


def _batch_processor(p: dict, i: int, taken: set[str], check_paths: bool) -> tuple[ProcessorConfig | None, list[str]]:
    """A processor of type batch_api: requests go to a provider's batch API (engines/batch_api.py)."""
    where = f"processors[{i}]"
    problems = _foreign_keys(p, where, _IMAGE_KEYS, "image_gen") + _foreign_keys(p, where, ("script_path", "function_name"), "custom")
    problems += _rate_limit_problems(p, where, "type is batch_api: the provider's batch queue has limits of its own")
    if p["type"] in taken:
        problems.append(f"{where}.type: a second 'batch_api' processor; outputs could not tell them apart")
    if "server_args" in p:
        problems.append(f"{where}.server_args: a batch_api processor loads no model; name the provider's model with model")
    if p["backend"] != "auto":
        problems.append(f"{where}.backend: a batch_api processor sends its requests to its provider's batch API; leave backend out")
    if not p["apply_chat_template"]:
        problems.append(f"{where}.apply_chat_template: a batch API takes chat messages (the provider applies its template): leave it true")
    provider = p.get("provider")
    if provider is None:
        return None, problems + [f"{where}.provider: required key is missing (openai or anthropic)"]
    max_requests, max_bytes = BATCH_LIMITS[provider]
    chunk_bytes = p.get("max_chunk_bytes", DEFAULT_MAX_CHUNK_BYTES)
    if chunk_bytes > max_bytes:
        problems.append(f"{where}.max_chunk_bytes: {chunk_bytes} is above {provider}'s limit of {max_bytes} bytes per batch")
    chunk_requests = p.get("max_requests_per_chunk") or max_requests
    if chunk_requests > max_requests:
        problems.append(
            f"{where}.max_requests_per_chunk: {chunk_requests} is above {provider}'s limit of {max_requests} requests per batch"
        )
    facts = BATCH_PROVIDER_FACTS[provider]
    problems += [
        f"{where}.{key}: a setting of the other provider's batch API; provider is {provider}" for key in facts["foreign"] if key in p
    ]
    # OpenAI's max_tokens in the sampling params: max_new_tokens (one name, as for api_llm)
    sampling = _max_tokens(dict(p["default_sampling_params"]), f"{where}.default_sampling_params", "batch_api", problems)
    problems += [
        f"{where}.default_sampling_params.{key}: an image generation parameter; only image_gen processors take it"
        for key in _IMAGE_PARAMS if key in sampling
    ]  # fmt: skip
    for key in ("temperature", "top_p"):  # MMIRAGE's place for them (Anthropic)
        if key in p:
            if key in sampling and sampling[key] != p[key]:
                problems.append(f"{where}.{key}: {p[key]} here, {sampling[key]} in default_sampling_params: set it once")
            sampling[key] = p[key]
    if facts["one_sampler"]:
        if "temperature" in sampling and "top_p" in sampling:
            problems.append(f"{where}: temperature and top_p are both set; Anthropic's models take one of them (MMIRAGE refuses both too)")
        if "temperature" not in sampling and "top_p" not in sampling:
            sampling["temperature"] = 0.0  # MMIRAGE's default for Anthropic batches
    sampling.pop("custom_params", None)
    retry = p.get("retry_policy") or {}
    model = p["model"] or BATCH_DEFAULT_MODEL[provider]
    metadata_path = p.get("metadata_output_path") or None
    settings = BatchSettings(
        provider=provider,
        max_chunk_bytes=chunk_bytes,
        max_requests_per_chunk=chunk_requests,
        metadata_output_path=os.path.expanduser(metadata_path) if metadata_path else None,
        metadata=dict(p.get("metadata") or {}),
        max_tokens=p.get("max_tokens"),
        **_given(p, "completion_window", "oversized_request_policy", "poll_seconds", "poll_max_seconds", endpoint="batch_endpoint"),
    )
    if settings.poll_max_seconds < settings.poll_seconds:  # the first poll's wait is the least
        settings = replace(settings, poll_max_seconds=settings.poll_seconds)
    return ProcessorConfig(
        type=p["type"],
        backend="batch_api",
        server_args=ServerArgs(model_path=model),
        sampling_params=sampling,
        chat_template_kwargs={},
        apply_chat_template=True,
        torch_threads=None,
        base_url=p["base_url"],
        api_key_env=p["api_key_env"] or BATCH_DEFAULT_KEY_ENV[provider],
        model=model,
        request_timeout=p.get("timeout_seconds", p["request_timeout"]),
        max_retries=max(0, retry.get("max_attempts", 3) - 1),
        native_n=False,
        index=i,
        batch=settings,
        pricing=p.get("pricing"),
    ), problems


def _image_processor(p: dict, i: int, taken: set[str], check_paths: bool) -> tuple[ImageGenProcessor | None, list[str]]:
    """A processor of type image_gen: where images are generated (mirageflow.imagegen)."""
    where = f"processors[{i}]"
    problems = _foreign_keys(p, where, _BATCH_KEYS, "batch_api") + _foreign_keys(p, where, ("script_path", "function_name"), "custom")
    problems += _unpriced_problems(p, where)
    problems += _rate_limit_problems(p, where, "type is image_gen")
    if p["type"] in taken:
        problems.append(f"{where}.type: a second 'image_gen' processor; outputs could not tell them apart")
    if "server_args" in p:
        problems.append(f"{where}.server_args: image_gen processors name their model in pipeline_args or sglang")
    backend = "external" if p["backend"] == "auto" else p["backend"]
    if backend not in IMAGE_BACKENDS:
        return None, problems + [f"{where}.backend: '{backend}' runs language models; image_gen takes external, diffusers or sglang"]
    block_of = {"external": "external", "diffusers": "pipeline_args", "sglang": "sglang"}
    block = p.get(block_of[backend])
    if block is None:
        return None, problems + [f"{where}.{block_of[backend]}: required key is missing (backend {backend})"]
    problems += [
        f"{where}.{key}: backend is {backend}; {key} is for backend {b}" for b, key in block_of.items() if b != backend and key in p
    ]
    params = dict(p["default_sampling_params"])
    problems += [
        f"{where}.default_sampling_params.{key}: not an image generation parameter (image_gen takes {', '.join(_IMAGE_PARAMS)})"
        for key in params if key not in _IMAGE_PARAMS
    ]  # fmt: skip
    if block.get("dtype"):
        problems.append(
            f"{where}.sglang.dtype: sglang 0.5.23's diffusion server has no --dtype flag; pass its own flags in extra_server_args"
        )
    key = block.get("api_key")
    if key not in (None, "", "EMPTY"):
        problems.append(
            f"{where}.{block_of[backend]}.api_key: a key written in the config would be stored with it (state_dir/configs); "
            "put it in an environment variable and name that with api_key_env"
        )
    model_path = block.get("model_path")
    output_dir = p.get("output_dir")
    return ImageGenProcessor(
        type=p["type"],
        backend=backend,
        base_url=block.get("base_url"),
        api_key_env=block.get("api_key_env") or p["api_key_env"],
        request_model=block.get("request_model"),
        model_path=os.path.expanduser(model_path) if model_path else None,
        revision=block.get("revision"),
        dtype=block.get("dtype"),
        **_given(block, *_IMAGE_BLOCK_SETTINGS),
        extra_server_args=tuple(block.get("extra_server_args") or ()),
        server_command=tuple(block["server_command"]) if block.get("server_command") else None,
        default_params=params,
        parallel_chunk_size=p.get("parallel_chunk_size") or ImageGenProcessor.parallel_chunk_size,
        output_dir=os.path.expanduser(output_dir) if output_dir else None,
        **_given(p, "parallel_inference", "file_format"),
        max_retries=p["max_retries"] if p["max_retries"] is not None else DEFAULT_MAX_RETRIES,
        max_restarts=p["max_restarts"],
        hang_seconds=p["hang_seconds"],
        index=i,
    ), problems


_IMAGE_BLOCK_SETTINGS = (
    "timeout_seconds", "max_concurrent_requests", "torch_dtype", "device", "enable_attention_slicing", "num_gpus",
    "startup_timeout_seconds",
)  # fmt: skip


def _given(entry: dict, *same: str, **renamed: str) -> dict:
    """The keys the entry sets, as a dataclass's keyword arguments (``field="key"`` where the names differ): an
    unset key takes the dataclass's default, written once there (the schema leaves these keys without one)."""
    pairs = [*((name, name) for name in same), *renamed.items()]
    return {name: entry[key] for name, key in pairs if key in entry}


# processors[].type -> its builder; any other type (llm) runs a model: _model_processor
PROCESSOR_TYPES: dict[str, Callable[[dict, int, set[str], bool], tuple]] = {
    "custom": _custom_processor,
    "batch_api": _batch_processor,
    "image_gen": _image_processor,
    "api_llm": _api_llm_processor,
}


def _listed(names: list[str], conjunction: str) -> str:
    """``a``, ``a and b``, ``a, b and c`` (for messages)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


# --------------------------------------------------------------------------- datasets and directories


def default_state_dir(output_dir: str) -> str:
    """The state_dir of a config without one: ``<first dataset's output_dir>/.mirageflow-state``.

    Per pipeline (an output_dir belongs to one pipeline, see pipeline_state's owner
    marker), the same for the driver, every job and ``mmirage status`` (no config file
    name needed), and hidden from readers of the output directory (pyarrow, datasets).
    """
    return os.path.join(output_dir, DEFAULT_STATE_SUBDIR)


def _datasets(entries: list[dict], check_paths: bool) -> tuple[list[DatasetConfig], list[str]]:
    """loading_params.datasets[]: each dataset, its files (with ``check_paths``), distinct output_dirs."""
    datasets, problems = [], []
    # a path mapping split -> path is one dataset per split (MMIRAGE's JSONL loader)
    split = [pair for i, ds in enumerate(entries) for pair in _split_datasets(ds, f"loading_params.datasets[{i}]", problems)]
    for where, ds in split:
        if not ds["path"].strip():
            problems.append(f"{where}.path: empty (a ${{VAR}} that expands to nothing?)")
        elif check_paths:
            problems += _dataset_problems(ds, where)
        if not ds["output_dir"].strip():
            problems.append(
                f"{where}.output_dir: empty (a ${{VAR}} that expands to nothing?); outputs would be written to the working directory's root"
            )
        if ds["shard_boundaries"] == "row_groups" and ds["type"].lower() != "parquet":
            problems.append(f"{where}.shard_boundaries: row_groups needs a Parquet dataset (type: parquet), not {ds['type']}")
        datasets.append(
            DatasetConfig(
                index=len(datasets),
                path=os.path.expanduser(ds["path"]),
                type=ds["type"].lower(),
                output_dir=os.path.expanduser(ds["output_dir"]),
                output_format=ds["output_format"],
                split=ds["split"],
                image_base_path=os.path.expanduser(ds["image_base_path"]) if ds.get("image_base_path") else None,
                allow_images_outside_base=bool(ds.get("allow_images_outside_base", False)),
                shard_boundaries=ds["shard_boundaries"],
                where=where,
            )
        )
    out_dirs = [d.output_dir for d in datasets]
    for i, d in enumerate(out_dirs):
        if d in out_dirs[:i]:
            problems.append(f"{datasets[i].key}.output_dir: '{d}' is already used by another dataset")
    return datasets, problems


def _split_datasets(ds: dict, where: str, problems: list[str]) -> list[tuple[str, dict]]:
    """A dataset entry, or one per split when its path is MMIRAGE's mapping split -> path (output_dir/<split> each)."""
    if not isinstance(ds["path"], Mapping):
        return [(where, ds)]
    out = []
    for split, path in ds["path"].items():
        if not split or split in (".", "..") or "/" in split or os.sep in split or split.startswith("."):
            problems.append(
                f"{where}.path.{split}: '{split}' cannot name the split's output folder (output_dir/<split>): use a plain name such as train"
            )
            continue
        # messages keep the entry's key path (loading_params.datasets[i]); they name the split's file
        out.append((where, {**ds, "path": path, "output_dir": os.path.join(ds["output_dir"], split)}))
    return out


def _dataset_problems(ds: dict, where: str) -> list[str]:
    path, kind = os.path.expanduser(ds["path"]), ds["type"].lower()
    if kind == "jsonl" and not os.path.isfile(path):
        why = (regular_file_problem(path) or "does not exist") + ("" if os.path.lexists(path) else path_hint(path))
        return [f"{where}.path: JSONL file '{path}' {why}"]
    if kind == "loadable" and not os.path.isdir(path):
        return [f"{where}.path: loadable dataset directory '{path}' does not exist{path_hint(path)}"]
    if kind == "parquet" and not (os.path.isfile(path) or os.path.isdir(path) or glob.glob(path)):
        hint = "" if glob.has_magic(path) else path_hint(path)
        return [f"{where}.path: no Parquet file, directory or glob match at '{path}'{hint}"]
    return []


def _state_dir(lp: dict, datasets: list[DatasetConfig]) -> tuple[str, list[str]]:
    """loading_params.state_dir, or the default under the first output_dir."""
    # (the first entry's output_dir: with splits, the folder above the splits' own)
    state_dir = (
        os.path.expanduser(lp["state_dir"]) if "state_dir" in lp else default_state_dir(os.path.expanduser(lp["datasets"][0]["output_dir"]))
    )
    if state_dir.strip():
        return state_dir, []
    return state_dir, [
        "loading_params.state_dir: empty (a ${VAR} that expands to nothing?); the workflow's targets would be "
        "put at the filesystem root. Set a directory, or leave the key out for the default "
        f"<first output_dir>/{DEFAULT_STATE_SUBDIR}"
    ]


def _path_problems(datasets: list[DatasetConfig], state_dir: str) -> list[str]:
    """Directories the workflow will write: creatable, writable, and none of them an input."""
    problems = []
    for out in datasets:
        d = out.output_dir
        if not d.strip():
            continue
        why = _unusable_dir(d)
        if why:
            problems.append(f"{out.key}.output_dir: {why}")
        for ds in datasets:
            if ds.path.strip():
                why = _input_overlap(d, ds)
                if why:
                    problems.append(f"{out.key}.output_dir: '{d}' {why} ({ds.key.removeprefix('loading_params.')}.path)")
    if state_dir.strip():
        why = _unusable_dir(state_dir)
        if why:
            problems.append(f"loading_params.state_dir: {why}")
    return problems


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
        return f"'{probe}' is a file, not a directory" + (
            "" if probe == os.path.abspath(path) else f", so '{path}' cannot be created under it"
        )
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


# --------------------------------------------------------------------------- inputs and outputs


def _inputs(entries: list[dict]) -> tuple[list[InputVar], list[str]]:
    """processing_params.inputs[]: the variables extracted from each row."""
    inputs, problems = [], []
    names: list[str] = []
    for i, var in enumerate(entries):
        where = f"processing_params.inputs[{i}]"
        if var["name"] in names:
            problems.append(f"{where}.name: duplicate variable '{var['name']}'")
        names.append(var["name"])
        try:
            prompts.compile_jmespath(var["key"])
        except ValueError as e:
            problems.append(f"{where}.key: {e}")
        inputs.append(
            InputVar(
                var["name"],
                var["key"],
                "default" in var,
                var.get("default"),
                bool(var.get("optional", False)),
                var["type"],
                var.get("max_side"),
                var.get("max_pixels"),
                var.get("max_bytes"),
            )
        )
        if var["type"] != "image":
            for key in ("max_side", "max_pixels", "max_bytes"):
                if key in var:
                    problems.append(f"{where}.{key}: only image inputs have {key} (type is '{var['type']}')")
    return inputs, problems


@dataclass
class _Variables:
    """The variables defined so far, in order, and the declared fields of JSON outputs
    (name -> fields: what templates may read as ``name.field``)."""

    names: list[str]
    json_fields: dict[str, list[str]] = field(default_factory=dict)

    def define(self, name: str) -> None:
        """``name`` is (re)defined with a value whose fields are not known."""
        self.names.append(name)
        self.json_fields.pop(name, None)


@dataclass
class _Scope:
    """What an output's builder may look at: the processors and the variables so far."""

    processors: dict[str, ProcessorConfig]
    custom: dict[str, CustomProcessor]
    inputs: list[InputVar]
    images: dict[str, ImageGenProcessor] = field(default_factory=dict)
    variables: _Variables = field(init=False)

    def __post_init__(self) -> None:
        self.variables = _Variables([v.name for v in self.inputs])


def _outputs(entries: list[dict], scope: _Scope) -> tuple[list[OutputVar], _Variables, list[str]]:
    """processing_params.outputs[]: each output in order, defining its variable for the next ones."""
    outputs, problems = [], []
    for i, out in enumerate(entries):
        if not out.get("name"):
            if out["type"] != "filter":
                problems.append(f"processing_params.outputs[{i}].name: required key is missing (the variable that holds the output)")
                continue
            out = {**out, "name": f"filter_{i}"}  # MMIRAGE's unnamed filter: a name for messages and counts
        make = OUTPUT_TYPES.get(out["type"], _llm_output)
        output, found = make(out, f"processing_params.outputs[{i}]", scope)
        outputs.append(output)
        problems += found
    return outputs, scope.variables, problems


def _llm_output(out: dict, where: str, scope: _Scope) -> tuple[OutputVar, list[str]]:
    """An output its processor's model computes (its type names the processor)."""
    known = scope.variables.names
    problems = []
    if out.get("predicate") is not None:
        problems.append(f"{where}.predicate: only outputs of type filter have a predicate")
    if out["name"] in known:
        problems.append(f"{where}.name: duplicate variable '{out['name']}'")
    if out["type"] not in scope.processors:
        problems.append(f"{where}.type: no '{out['type']}' processor is defined in processors")
    problems += [f"{where}.{key}: only image_gen outputs have {key}" for key in _IMAGE_OUTPUT_KEYS if key in out]
    batch = scope.processors[out["type"]].batch if out["type"] in scope.processors else None
    if batch is not None and not BATCH_PROVIDER_FACTS[batch.provider]["prefill"] and out["response_prefix"]:
        problems.append(
            f"{where}.response_prefix: OpenAI's chat completions cannot continue an assistant message "
            "(provider anthropic can); leave it out"
        )
    for key in ("prompt", "system"):
        if out.get(key):
            problems += prompts.template_problems(out[key], known, f"{where}.{key}", scope.variables.json_fields)
    problems += _conversation_problems(out, where, [v.name for v in scope.inputs], known, scope.processors)
    is_json = out["output_type"].lower() == "json"
    schema, found = _output_schema(out, where, is_json)
    problems += found
    known.append(out["name"])
    if out.get("keep_reasoning"):
        reasoning_name = f"{out['name']}_reasoning"
        if reasoning_name in known:
            problems.append(f"{where}.keep_reasoning: variable '{reasoning_name}' is already defined")
        scope.variables.define(reasoning_name)
    scope.variables.json_fields.pop(out["name"], None)
    if schema is not None and schema.fields:
        scope.variables.json_fields[out["name"]] = [f.name for f in schema.fields]
    proc = scope.processors.get(out["type"])
    sampling = _max_tokens(out["sampling_params"], f"{where}.sampling_params", proc.backend if proc else None, problems)
    return OutputVar(
        out["name"], out["type"], out["prompt"], out["system"], out["response_prefix"], is_json, schema,
        sampling, out["allow_empty_output"], bool(out.get("keep_reasoning", False)),
        conversation=out.get("conversation"),
    ), problems  # fmt: skip


def _output_schema(out: dict, where: str, is_json: bool) -> tuple[json_output.OutputSchema | None, list[str]]:
    """A JSON output's fields (none declared: any object); None for a text output."""
    if "output_schema" not in out:
        return (json_output.OutputSchema.parse([], f"{where}.output_schema") if is_json else None), []
    if not is_json:
        return None, [f"{where}.output_schema: only JSON outputs have an output_schema (output_type is '{out['output_type']}')"]
    try:
        return json_output.OutputSchema.parse(out["output_schema"], f"{where}.output_schema"), []
    except json_output.SchemaError as e:
        return None, e.problems


def _conversation_problems(out: dict, where: str, input_names: list[str], known: list[str], processors: dict) -> list[str]:
    """An output's ``conversation``: an input variable, a processor that applies the chat
    template; without it the output needs a prompt."""
    name = out.get("conversation")
    if name is None:
        return [] if out.get("prompt") else [f"{where}.prompt: required key is missing (or set conversation to send a row's chat messages)"]
    problems = []
    if name not in input_names:
        why = "an output is text or a JSON object, not a list of messages" if name in known else "no such input"
        problems.append(
            f"{where}.conversation: '{name}' must name an input variable holding the chat messages ({why})"
            + prompts.did_you_mean(name, input_names)
        )
    proc = processors.get(out["type"])
    if proc is not None and not proc.apply_chat_template:
        problems.append(f"{where}.conversation: needs processors[].apply_chat_template: true (a conversation is sent as chat messages)")
    return problems


_LLM_ONLY_OUTPUT_KEYS = (
    "prompt", "system", "conversation", "output_schema", "response_prefix", "sampling_params", "keep_reasoning", "allow_empty_output",
)  # fmt: skip


def _llm_only_key_problems(out: dict, where: str) -> list[str]:
    return [
        f"{where}.{key}: only LLM outputs have a {key} (this output's type is {out['type']})"
        for key in _LLM_ONLY_OUTPUT_KEYS
        if out.get(key)
    ] + [f"{where}.{key}: only image_gen outputs have {key}" for key in _IMAGE_OUTPUT_KEYS if key in out]


def _filter_output(out: dict, where: str, scope: _Scope) -> tuple[OutputVar, list[str]]:
    """A filter (mirageflow.shard.steps.python): a predicate over the variables so far; it defines none."""
    problems = _llm_only_key_problems(out, where)
    if out.get("predicate") is None:
        problems.append(f"{where}.predicate: required key is missing (a filter keeps the rows where it is true, e.g. 'score > 33')")
    else:
        problems += prompts.predicate_problems(out["predicate"], scope.variables.names, f"{where}.predicate", scope.variables.json_fields)
    return _python_step(out), problems


def _custom_output(out: dict, where: str, scope: _Scope) -> tuple[OutputVar, list[str]]:
    """A custom step's output (mirageflow.shard.steps.python): the function's value, any JSON."""
    problems = _llm_only_key_problems(out, where)
    if out.get("predicate") is not None:
        problems.append(f"{where}.predicate: only outputs of type filter have a predicate")
    if "custom" not in scope.custom:
        problems.append(f"{where}.type: no 'custom' processor is defined in processors (type: custom, script_path, function_name)")
    if out["name"] in scope.variables.names:
        problems.append(f"{where}.name: duplicate variable '{out['name']}'")
    scope.variables.define(out["name"])  # any value: its fields are not checked
    return _python_step(out), problems


def _python_step(out: dict) -> OutputVar:
    kind = out["type"]
    return OutputVar(out["name"], kind, None, None, "", False, None, {}, kind=kind, predicate=out.get("predicate"))


_IMAGE_OUTPUT_KEYS = (
    "output_mode",
    "filename_template",
    "width",
    "height",
    "seed",
    "guidance_scale",
    "num_inference_steps",
    "negative_prompt",
)
# What a filename_template may use besides the row's variables (shard/steps/image.py).
IMAGE_NAME_VARIABLES = ("__shard_id", "__sample_index", "__source_index", "__dataset", "__output_name", "__source_hash")
DEFAULT_FILENAME_TEMPLATE = "generated_{{ __shard_id }}_{{ __sample_index }}_{{ __source_hash }}"


def _image_output(out: dict, where: str, scope: _Scope) -> tuple[OutputVar, list[str]]:
    """An image_gen output: one image per row written to a file; the variable is its path
    (relative to the dataset's output_dir), ``<name>_seed`` its seed."""
    known = scope.variables.names
    problems = [
        f"{where}.{key}: only LLM outputs have a {key} (this output's type is image_gen)"
        for key in ("system", "conversation", "output_schema", "response_prefix", "keep_reasoning", "allow_empty_output", "sampling_params")
        if out.get(key)
    ]  # fmt: skip
    if out["output_type"].lower() != "plain":
        problems.append(f"{where}.output_type: an image_gen output is an image file (its path), not {out['output_type']}")
    if out.get("predicate") is not None:
        problems.append(f"{where}.predicate: only outputs of type filter have a predicate")
    if "image_gen" not in scope.images:
        problems.append(f"{where}.type: no 'image_gen' processor is defined in processors")
    if out.get("output_mode", "path") != "path":
        problems.append(
            f"{where}.output_mode: 'pil' keeps images in memory, which records cannot hold; images are written as files "
            "and the variable is the file's path (output_mode: path)"
        )
    images = [v.name for v in scope.inputs if v.type == "image"]
    for key in ("prompt", "negative_prompt"):
        text = out.get(key)
        if key == "prompt" and not text:
            problems.append(f"{where}.prompt: required key is missing (the text the image is generated from)")
        if text:
            problems += prompts.template_problems(text, known, f"{where}.{key}", scope.variables.json_fields)
            used = sorted(_named(text) & set(images))
            if used:
                problems.append(f"{where}.{key}: image input(s) {', '.join(used)}: image generation takes text prompts only")
    template = out.get("filename_template") or DEFAULT_FILENAME_TEMPLATE
    problems += prompts.template_problems(
        template, [*known, *IMAGE_NAME_VARIABLES], f"{where}.filename_template", scope.variables.json_fields
    )
    for name in (out["name"], f"{out['name']}_seed", f"{out['name']}_path"):
        if name in known:
            problems.append(f"{where}.name: variable '{name}' is already defined")
        scope.variables.define(name)
    image = ImageOutput(
        filename_template=template, output_mode=out.get("output_mode", "path"), width=out.get("width"), height=out.get("height"),
        seed=out.get("seed"), guidance_scale=out.get("guidance_scale"), num_inference_steps=out.get("num_inference_steps"),
        negative_prompt=out.get("negative_prompt"),
    )  # fmt: skip
    return OutputVar(out["name"], out["type"], out.get("prompt"), None, "", False, None, {}, kind="image_gen", image=image), problems


def _named(template: str) -> set[str]:
    """The variables a template names (empty when it does not parse: template_problems says why)."""
    try:
        return prompts.template_variables(template)
    except Exception:  # noqa: BLE001 - a syntax error is reported by template_problems
        return set()


# outputs[].type -> its builder; any other type names the processor of an LLM output: _llm_output
OUTPUT_TYPES: dict[str, Callable[[dict, str, _Scope], tuple[OutputVar, list[str]]]] = {
    "filter": _filter_output,
    "custom": _custom_output,
    "image_gen": _image_output,
}


def _image_problems(cfg: dict, inputs: list[InputVar]) -> list[str]:
    """Image inputs need the chat template (it writes the model's image placeholders) and
    go into the user turn only. (A text-only model is preflight's check: it reads config.json.)"""
    images = [v.name for v in inputs if v.type == "image"]
    if not images:
        return []
    problems = []
    outputs = [o for o in cfg["processing_params"]["outputs"] if o.get("type", "llm") not in ("filter", "custom", "image_gen")]
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
                named = prompts.template_variables(system)
            except Exception:  # noqa: BLE001 - a syntax error is reported by template_problems
                continue
            for name in sorted(named & set(images)):
                problems.append(
                    f"processing_params.outputs[{i}].system: image input '{name}' can only be used in the prompt (the user turn)"
                )
    return problems


def reserved_name_problems(pp: dict) -> list[str]:
    """Inputs, outputs and output_schema fields named like a field the workflow writes into
    every record (prompts.RESERVED_RECORD_FIELDS): the record would silently hold the
    workflow's value instead of theirs. ``source_index`` is also MMIRAGE's built-in (the
    row's index): an input of that name and an output_schema field that renders it are
    accepted (prompts.RecordRenderer checks per row that the field is the row's index); an
    output of that name, or a field that renders something else, is refused."""
    reserved = prompts.RESERVED_RECORD_FIELDS
    why = "is reserved: the workflow writes it into every record ({}); choose another name".format(", ".join(reserved))
    problems = []
    for kind in ("inputs", "outputs"):
        for i, var in enumerate(pp.get(kind) or []):
            if not isinstance(var, Mapping) or var.get("name") not in reserved or var.get("type") == "filter":
                continue
            if kind == "inputs" and var["name"] == BUILTIN_INDEX:
                continue  # MMIRAGE's recovery configs: the row's own index column
            problems.append(f"processing_params.{kind}[{i}].name: '{var['name']}' {why}")
    shape = pp.get("output_schema")
    if isinstance(shape, Mapping):
        for key in shape:
            if key == BUILTIN_INDEX and isinstance(shape[key], str) and re.search(rf"\b{BUILTIN_INDEX}\b", shape[key]):
                continue  # `source_index: "{{ source_index }}"`: the row's index, as every record holds
            if key in reserved:
                problems.append(f"processing_params.output_schema.{key}: '{key}' {why}")
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


# --------------------------------------------------------------------------- execution and deduplication


def _execution(ep: dict, processors: dict[str, ProcessorConfig], outputs: list[OutputVar]) -> tuple[ExecutionParams, list[str]]:
    """execution_params: the SLURM keys' mistakes, engine groups that would load nothing, engines across nodes."""
    problems = cluster.execution_problems(ep)
    used = sorted({processors[o.processor].backend for o in outputs if o.processor in processors})
    if ep["shards_per_engine"] > 1 and not any(registry.capabilities(b).loads_model for b in used):
        what = (
            f"every processor of this pipeline's outputs uses backend {_listed(used, 'or')} (a remote server, nothing to load)"
            if used else "no output of this pipeline uses a processor with a model (nothing to load)"
        )  # fmt: skip
        problems.append(f"execution_params.shards_per_engine: shared engines serve processors that load a model; {what}: set it to 1")
    waiting = [processors[o.processor] for o in outputs if o.processor in processors]
    problems += node_span_problems(ep, list({id(p): p for p in waiting}.values()), [o.name for o in outputs if o.image is not None])
    if any(p.batch is not None for p in waiting) and not any(registry.capabilities(p.backend).loads_model for p in waiting):
        for key in ("gpus", "gres"):
            if ep[key]:
                problems.append(
                    f"execution_params.{key}: the shards of this pipeline only wait on a batch API (nothing is loaded on the "
                    "node): they are CPU-only jobs; leave it unset (see docs/cluster.md, batch APIs)"
                )
    batched = [o.name for o in outputs if o.processor in processors and processors[o.processor].batch is not None]
    if ep["canary_rows"] and batched:
        # refused rather than waited on: the canary's batch, then the shards' batches, would be two
        # provider turnarounds (each up to its completion window) with every shard idle in between
        problems.append(
            f"execution_params.canary_rows: output(s) {_listed(batched, 'and')} go to a batch_api processor, so the canary "
            "would submit a batch of its own and every shard would wait (up to the provider's completion window, 24 h) "
            "for it before submitting theirs; remove canary_rows (try the prompt on a small dataset first instead)"
        )
    used_keys = {k: v for k, v in ep.items() if f"execution_params.{k}" not in IGNORED_MMIRAGE_KEYS}
    if used_keys.get("publish") is not None:
        used_keys["publish"] = PublishParams(**used_keys["publish"])
    return ExecutionParams(**used_keys), problems


def _dedup(cfg: dict, outputs: list[OutputVar]) -> tuple[DedupParams | None, list[str]]:
    """deduplication_params when enabled, and the mistakes the schema cannot see: no merge to read, no text field."""
    dp, pp = cfg["deduplication_params"], cfg["processing_params"]
    if not dp["enabled"]:
        return None, []
    where = "deduplication_params"
    params = DedupParams(**{k: dp[k] for k in ("enabled", "exact", "fuzzy", "text_field", "threshold", "num_perm", "shingle_size")})
    problems = []
    if not cfg["execution_params"]["merge"]:
        problems.append(f"{where}.enabled: needs execution_params.merge: true (deduplication reads <output_dir>/merged/)")
    if not (dp["exact"] or dp["fuzzy"]):
        problems.append(f"{where}: exact and fuzzy are both false, so nothing would be removed; set one, or enabled: false")
    field_ = dp["text_field"]
    if not field_:
        problems.append(f"{where}.text_field: required when enabled (the record field whose text is compared)")
        return params, problems
    produced = produced_fields(pp["output_schema"], outputs, pp["preserve_columns"])
    # with remove_columns false a source column may be meant: preflight looks at the first rows
    if field_ not in produced and pp["remove_columns"]:
        problems.append(
            f"{where}.text_field: '{field_}' is not a field of the records (remove_columns is true; "
            f"fields: {', '.join(produced) or 'none'})" + prompts.did_you_mean(field_, produced)
        )
    return params, problems
