"""The pipeline config as typed values: what ``load_config`` returns and every job reads.

One frozen dataclass per section of the schema (workflow/schemas/config.schema.yaml, which
documents every key and its default). Building and validating them is config/loading.py's;
this module imports nothing of the package at run time, so any module can annotate a
``cfg: PipelineConfig`` or a ``processor: ProcessorConfig`` without an import circle.

The schema is the source of defaults and choices (it fills the defaults while validating); a
dataclass default serves only a value built without the loader, and tests/test_config_types.py
holds each default to the schema's and each ``Literal`` to the key's enum. Every field is always
there: read ``cfg.x``, never ``getattr(cfg, "x", default)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: the parsed schema of a JSON output
    from mirageflow.prompts.json_output import OutputSchema

# The choices of the config, as the schema's enums hold them (tests/test_config_types.py checks each
# against its enum). The schema refuses any other value before these types are built.
DatasetType = Literal["jsonl", "parquet", "loadable"]  # loading_params.datasets[].type, lower-cased
OutputFormat = Literal["parquet", "jsonl"]
ShardBoundaries = Literal["rows", "row_groups"]  # MMIRAGE's formula, or a Parquet dataset's row-group starts
InputType = Literal["text", "image"]
StepKind = Literal["llm", "custom", "filter", "image_gen"]  # outputs[].type as a step (api_llm, batch_api: llm)
ImageOutputMode = Literal["path", "pil"]
ModelProcessorType = Literal["llm", "api_llm", "batch_api"]  # processors[].type of a ProcessorConfig
# processors[].backend of a ProcessorConfig: the engine registry's configurable backends, and batch_api (set by
# the builder for type batch_api)
LLMBackend = Literal["auto", "transformers", "sglang", "sglang_server", "vllm_server", "openai", "batch_api"]
ImageBackend = Literal["external", "diffusers", "sglang"]  # of an image_gen processor ("auto": external)
TorchDtype = Literal["auto", "float16", "fp16", "bfloat16", "bf16", "float32", "fp32"]
ImageFileFormat = Literal["png", "jpg", "jpeg", "webp"]
StartMethod = Literal["spawn", "forkserver", "fork"]  # multiprocessing's, of a custom processor's workers
BatchProvider = Literal["openai", "anthropic"]
CompletionWindow = Literal["24h"]
BatchEndpoint = Literal["/v1/chat/completions"]
OversizedRequestPolicy = Literal["isolate", "reject"]
PrefixOrder = Literal["window", "shard", "none"]  # shard/prefix_order.py
ExecutionMode = Literal["local", "slurm"]


@dataclass(frozen=True)
class DatasetConfig:
    index: int
    path: str
    type: DatasetType  # normalised to lower case
    output_dir: str
    output_format: OutputFormat
    split: str | None
    image_base_path: str | None = None  # relative image paths start here (default: the dataset's folder)
    allow_images_outside_base: bool = False  # image paths may leave image_base_path (prompts/images.py)
    shard_boundaries: ShardBoundaries = "rows"  # data/sharding.py
    where: str = ""  # its entry's key path, loading_params.datasets[i] (one entry is several datasets with {split: path})

    @property
    def key(self) -> str:
        return self.where or f"loading_params.datasets[{self.index}]"


@dataclass(frozen=True)
class InputVar:
    name: str
    key: str
    has_default: bool
    default: Any
    optional: bool = False  # the key may be missing from the first rows (no preflight data check)
    type: InputType = "text"  # mirageflow.prompts.images
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
    schema: OutputSchema | None
    sampling_params: dict
    allow_empty_output: bool = False
    keep_reasoning: bool = False  # the reasoning becomes the variable <name>_reasoning
    conversation: str | None = None  # an input variable holding the chat messages sent (prompts.PromptBuilder)
    kind: StepKind = "llm"  # custom, filter: mirageflow.shard.steps.python
    predicate: str | None = None  # of a filter
    image: ImageOutput | None = None  # of an image_gen output (mirageflow.shard.steps.image)


@dataclass(frozen=True)
class ImageOutput:
    """An ``outputs[]`` entry of type image_gen: MMIRAGE's keys (the schema documents each)."""

    filename_template: str
    output_mode: ImageOutputMode = "path"
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    guidance_scale: float | None = None
    num_inference_steps: int | None = None
    negative_prompt: str | None = None


@dataclass(frozen=True)
class ServerArgs:
    """``processors[].server_args``: what loads the model (the schema closes this mapping)."""

    model_path: str
    tp_size: int | None = 1  # None: the job's GPUs / dp_size (engines/sglang_common.resolve_parallelism)
    dp_size: int | None = 1
    trust_remote_code: bool = False
    disable_custom_all_reduce: bool = False
    # passed verbatim to the engine (SGLang's own arguments, transformers' dtype): not ours to type
    extra_engine_args: dict[str, Any] = field(default_factory=dict)
    # a Hugging Face model id's branch, tag or commit (mirageflow.hub_models resolves it to a snapshot; not an engine argument)
    revision: str | None = None

    def engine_args(self) -> dict[str, Any]:
        """Every key but ``extra_engine_args``, as SGLang names its arguments (``--flag`` of its server)."""
        return {
            "model_path": self.model_path, "tp_size": self.tp_size, "dp_size": self.dp_size,
            "trust_remote_code": self.trust_remote_code, "disable_custom_all_reduce": self.disable_custom_all_reduce,
        }  # fmt: skip


DEFAULT_MAX_RETRIES = 5  # processors[].max_retries: null (the schema's default)


@dataclass(frozen=True)
class LaunchedServer:
    """The server a shard launches and supervises (engines/server_restarts.py): the options of backends
    sglang_server and vllm_server, and of auto (which may pick vllm_server). The schema keeps them flat in
    ``processors[]``; each field's key is named beside it."""

    command: list[str] | None = None  # server_command: the launcher the flags follow (None: the package's)
    env: dict | None = None  # server_env: extra environment of the launched server only
    start_timeout: float = 900.0  # server_start_timeout


@dataclass(frozen=True)
class ApiOptions:
    """How many requests an OpenAI-compatible endpoint gets at once and at what pace: the options of backend
    openai (type api_llm), and of auto (whose vllm_server is fed through the openai backend)."""

    max_concurrency: int | None = None  # requests in flight (MMIRAGE's api_llm); None: the engine's default
    retry_base_delay: float | None = None  # first retry delay; None: the engine's default
    # the pace the run's shards keep together (transport/rate_limit.py); None: no limit
    max_requests_per_minute: float | None = None
    max_tokens_per_minute: float | None = None


@dataclass(frozen=True)
class ProcessorConfig:
    """A ``processors[]`` entry that runs a language model (types llm, api_llm, batch_api). What every backend
    reads is here; what only some backends have is in one option group each, set where the backend has it and
    None elsewhere (config/build.py fills them): ``launch`` (a launched server), ``api`` (an OpenAI-compatible
    endpoint's pace), ``batch`` (a provider's batch API)."""

    type: ModelProcessorType
    backend: LLMBackend
    server_args: ServerArgs
    sampling_params: dict
    chat_template_kwargs: dict
    apply_chat_template: bool
    torch_threads: int | None  # transformers (and auto, which may pick it)
    # where requests go: openai, batch_api; vllm_server names its served model with model (see the schema)
    base_url: str | None = None
    api_key_env: str | None = None
    model: str | None = None
    request_timeout: float = 600.0
    max_retries: int = DEFAULT_MAX_RETRIES
    native_n: bool | None = None  # n_samples: one request with n (None: where the backend has it)
    index: int = 0  # position in processors[] (the key path of its problems)
    # an engine that dies is brought back in the job this many times: a launched server restarted
    # (engines/server_restarts.py), an in-process transformers model reloaded after a device error
    max_restarts: int = 3
    # frozen: no answer, no health for this many seconds (killed, then restarted as max_restarts says): a launched
    # server's, and the engine service's of shards_per_engine (any backend it serves); None: never watched
    hang_seconds: float | None = 300.0
    launch: LaunchedServer | None = None  # sglang_server, vllm_server, auto
    api: ApiOptions | None = None  # openai (type api_llm), auto
    batch: BatchSettings | None = None  # type batch_api: the provider's batch API (engines/batch_api.py)
    nodes: int = 1  # nodes its engine spans: execution_params.nodes (engines/server_ranks.py)
    # what its tokens cost (stats/pricing.py): {input_per_million, cached_input_per_million, output_per_million, gpu_hour_usd}
    pricing: dict | None = None


# The providers' own limits on one batch (requests, bytes of its JSONL): OpenAI Batch (a 200 MB
# input file, 50,000 requests) and Anthropic Message Batches (256 MB, 100,000 requests).
BATCH_LIMITS = {"openai": (50_000, 200_000_000), "anthropic": (100_000, 256_000_000)}


@dataclass(frozen=True)
class BatchSettings:
    """``processors[]`` of type batch_api: MMIRAGE's keys and ours (the schema documents each)."""

    provider: BatchProvider
    max_chunk_bytes: int  # at most the provider's file limit (build checks it)
    max_requests_per_chunk: int  # at most the provider's request limit
    metadata_output_path: str | None = None
    completion_window: CompletionWindow = "24h"
    endpoint: BatchEndpoint = "/v1/chat/completions"  # OpenAI's batch_endpoint
    oversized_request_policy: OversizedRequestPolicy = "isolate"
    metadata: dict[str, str] = field(default_factory=dict)  # sent with each batch (OpenAI)
    max_tokens: int | None = None  # Anthropic: max_tokens when the sampling params have no max_new_tokens
    poll_seconds: float = 10.0  # first status poll after this long; then x1.5 per poll
    poll_max_seconds: float = 300.0
    deadline_grace_seconds: float = 3600.0  # past the window + this, a batch is cancelled and treated as expired


@dataclass(frozen=True)
class ImageGenProcessor:
    """``processors[]`` entry of type image_gen: where images are generated (mirageflow.imagegen)."""

    type: Literal["image_gen"]
    backend: ImageBackend
    base_url: str | None = None  # external
    api_key_env: str | None = None
    request_model: str | None = None  # the "model" field of each request (external, sglang)
    timeout_seconds: float = 900.0
    max_concurrent_requests: int = 1
    model_path: str | None = None  # diffusers (pipeline_args.model_path), sglang (sglang.model_path)
    revision: str | None = None
    torch_dtype: TorchDtype = "auto"  # diffusers
    device: str = "auto"  # diffusers
    enable_attention_slicing: bool = False  # diffusers
    num_gpus: int = 1  # sglang
    dtype: str | None = None  # sglang
    startup_timeout_seconds: float = 900.0  # sglang
    extra_server_args: tuple[str, ...] = ()  # sglang
    server_command: tuple[str, ...] | None = None  # sglang: the launcher the flags follow (None: sglang serve)
    default_params: dict = field(default_factory=dict)  # default_sampling_params (num_inference_steps, ...)
    parallel_inference: bool = True
    parallel_chunk_size: int | None = 4
    output_dir: str | None = None  # None: <dataset output_dir>/images
    file_format: ImageFileFormat = "png"
    max_retries: int = DEFAULT_MAX_RETRIES
    # sglang: its launched server restarted in the job when it dies or freezes (as an LLM server's)
    max_restarts: int = 3
    hang_seconds: float | None = 300.0
    index: int = 0


@dataclass(frozen=True)
class CustomProcessor:
    """``processors[]`` entry of type custom: a Python function (mirageflow.shard.steps.python)."""

    type: Literal["custom"]
    script_path: str
    function_name: str
    max_workers: int = 1
    start_method: StartMethod = "spawn"
    timeout_ms: int | None = None
    fallback_value: Any = None  # accepted and unused (IGNORED_MMIRAGE_KEYS): set, the shard log warns
    index: int = 0  # position in processors[] (the key path of its problems)


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
    request_cache: bool = True  # keep answers by request key (shard/request_cache.py)
    prefix_order: PrefixOrder = "window"


# MMIRAGE keys accepted so that its files run unchanged, and that change nothing here: key path -> why. The
# builder leaves them out of the typed config (no field holds them, except fallback_value, kept to warn
# that it is not used); the schema describes each as unused and docs/mmirage.md's table names each
# (tests/test_config_types.py checks both, and that a config setting them loads).
IGNORED_MMIRAGE_KEYS: dict[str, str] = {
    "loading_params.shard_id": "every shard is its own Snakemake job (mmirage run --shard-id N runs one)",
    "processors[].chat_template": "MMIRAGE picks the image placeholder token with it; here the model's own chat template "
    "does (a config warning says so)",
    "processors[].max_timeouts": "a timed-out call of a custom function is its row's error",
    "processors[].max_errors": "a failed call of a custom function is its row's error (shard_params decide when the shard fails)",
    "processors[].fallback_value": "a failed call of a custom function is its row's error, never this value (the shard log warns)",
    "processors[].sglang.port": "the image server gets a free port",
    "execution_params.job_name": "SLURM job names come from the profile's slurm-jobname-prefix",
    "execution_params.poll_interval_seconds": "the Snakemake profile's status polling applies",
    "execution_params.settle_time_seconds": "the Snakemake profile's latency-wait applies",
    "execution_params.project_root": "Snakemake's working directory is the root",
    "execution_params.report_dir": "logs go under <state_dir>/logs",
    "execution_params.edf_env": "no container environment file is used",
}


@dataclass(frozen=True)
class PublishParams:
    """``execution_params.publish``: the upload after the merge (mirageflow.publish)."""

    repo_id: str
    private: bool = False
    revision: str | None = None
    allow_partial: bool = False
    overwrite_other: bool = False


@dataclass(frozen=True)
class ExecutionParams:
    """``execution_params``: MMIRAGE's execution keys; the SLURM ones become job resources
    (mirageflow.cluster.resources), ``hf_home`` the jobs' HF_HOME, ``shards_per_engine`` the
    engine groups (mirageflow.cluster.engine_service). Defaults: the schema's. The keys that change
    nothing (IGNORED_MMIRAGE_KEYS) have no field."""

    mode: ExecutionMode = "local"
    retry: bool = False
    merge: bool = True
    max_retries: int = 3
    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    reservation: str | None = None
    nodes: int = 1
    ntasks_per_node: int = 1
    gpus: int | None = None
    gres: str | None = None
    cpus_per_task: int | None = None
    mem: str | int | None = None
    time_limit: str = "11:59:59"
    max_time_limit: str | None = None
    constraint: str | None = None
    slurm_extra: str | None = None
    shards_per_engine: int = 1
    max_cost_usd: float | None = None  # the run's budget in dollars (transport/spend.py)
    allow_over_budget: bool = False  # check and the DAG build warn instead of refusing an over-budget forecast
    canary_rows: int | None = None  # run this many rows of shard 0 first; the shards wait for its verdict (shard/canary.py)
    hf_home: str | None = None
    license: str | None = None  # the dataset card's (mirageflow.publish.card)
    publish: PublishParams | None = None


@dataclass(frozen=True)
class DedupParams:
    """``deduplication_params`` (mirageflow.data.dedup)."""

    enabled: bool
    exact: bool
    fuzzy: bool
    text_field: str | None
    threshold: float
    num_perm: int
    shingle_size: int


@dataclass(frozen=True)
class PipelineConfig:
    # The validated, expanded config with defaults filled in. Read only inside the config
    # package (records_identity hashes it as written); everything else reads the fields.
    raw: dict = field(repr=False)
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
    n_samples: int = 1  # records per input row (mirageflow/shard/samples.py)
    preserve_columns: tuple[str, ...] = ()
    # processors of type custom (Python functions; no engine), by type
    custom_processors: dict[str, CustomProcessor] = field(default_factory=dict)
    # processors of type image_gen, by type (an output of that type writes images)
    image_processors: dict[str, ImageGenProcessor] = field(default_factory=dict)
    dedup: DedupParams | None = None  # deduplication_params when enabled (data/dedup.py)
    execution: ExecutionParams = field(default_factory=ExecutionParams)
    # what the driver and `mmirage check` say without refusing (an MMIRAGE key that changes nothing here)
    warnings: tuple[str, ...] = ()
    fresh_answers: bool = False  # this run takes no answer from the request cache
    # the canary's config (shard/canary.py): the run's own state_dir, where the files every shard of
    # the run shares live (the spend ledger, the rate limits); None: state_dir is the run's
    run_state_dir: str | None = None

    @property
    def shared_state_dir(self) -> str:
        """Where the run's shared files live (the canary's config names its run's)."""
        return self.run_state_dir or self.state_dir

    def shard_dir(self, shard_id: int) -> Path:
        return Path(self.state_dir) / f"shard_{shard_id}"
