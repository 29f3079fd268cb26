"""The package's common errors: the base class, input errors, and the row errors. The other
exception classes live beside the modules that raise them (``ConfigError`` in config,
``ShardFailed`` in shard/failures.py, ``EngineStopped`` in engines/base.py, ...), each a
``MirageflowError``.

- ``MirageflowError``: the base of every exception this package raises on purpose (each
  keeps its other base too, e.g. ``ConfigError`` is also a ``ValueError``), so a caller
  can tell our errors from a bug or a library's.
- ``InputError``: what the user gave (arguments, the config, the state_dir) cannot be
  used and nothing was started: ``mmirage`` exits 2 with its message. The CLI catches
  only these for exit 2, never any ``ValueError``.
- ``RowError`` and ``RowErrorClass``: one row (or sample) failed at one stage; the shard
  records it in ``errors.jsonl`` with its class and goes on. The class says what went
  wrong and whether a retry can help (``deterministic``: the config, prompt or data decide
  it, so a retry fails the same way). ``mmirage status``/``retry``, the run summary and the
  docs/troubleshooting.md's list (``scripts/row_error_docs.py``) all read it from here.
"""

from __future__ import annotations

import enum


# The exit codes of `mmirage` and of a run that ended with shards not done (report/terminal.py).
EXIT_OK = 0
EXIT_FAILED = 1  # Snakemake failed, or shards failed
EXIT_USAGE = 2  # bad arguments or config
EXIT_INCOMPLETE = 3  # shards still pending or running (status, merge)


class MirageflowError(Exception):
    """Base of the errors mirageflow raises on purpose."""


class InputError(MirageflowError):
    """The input (arguments, config, state_dir) cannot be used; nothing was started."""


class StateMismatch(InputError, ValueError):
    """The state_dir holds another run's state (another num_shards): it cannot be mixed with this one."""


class RowErrorClass(enum.StrEnum):
    """The class of a row error (``error`` in errors.jsonl, ``rows_failed_by_class``).

    A ``str``: written to JSON as its value, equal to it (``RowErrorClass.BAD_ROW == "bad_row"``).
    """

    def __new__(cls, value: str, stage: str, deterministic: bool, meaning: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.stage = stage  # where in the row's way it happens
        member.deterministic = deterministic  # a retry fails the same way: fix the config, prompt or data
        member.meaning = meaning
        return member

    # reading the dataset
    BAD_ROW = "bad_row", "read", True, "a malformed input row: not valid UTF-8 or JSON, not an object, a value that cannot be converted"
    INVALID_UNICODE = (
        "invalid_unicode",
        "read, output",
        True,
        "text with a lone UTF-16 surrogate, in the input row or in the model's answer",
    )
    UNREADABLE_ROW_GROUP = (
        "unreadable_row_group",
        "read",
        False,
        "a Parquet row group that cannot be read (its rows fail; the file is named)",
    )
    UNREADABLE_ROWS = "unreadable_rows", "read", False, "rows of a loadable (save_to_disk) dataset that cannot be read"
    # variables
    EXTRACT_ERROR = "extract_error", "extract", True, "a JMESPath key failed on the row (e.g. a function on the wrong type)"
    MISSING_VARIABLE = "missing_variable", "extract", True, "an input key is not in the row"
    # prompts
    TEMPLATE_ERROR = "template_error", "render", True, "a Jinja2 prompt or record template failed (an undefined variable, a filter's error)"
    TEMPLATE_TIMEOUT = "template_timeout", "render", True, "a template's render ran past its time limit (a loop over a huge range)"
    TEMPLATE_TOO_LARGE = (
        "template_too_large",
        "render",
        True,
        "a template's render made, or would make, more than its size limits (output, operands, calls)",
    )
    BAD_CONVERSATION = "bad_conversation", "render", True, "a chat-message input is not a list of messages"
    CHAT_TEMPLATE = "chat_template", "render", True, "the model's chat template refused the messages"
    IMAGE_OUTSIDE_BASE = (
        "image_outside_base",
        "image",
        True,
        "an image path that leads outside the dataset's image_base_path (allow_images_outside_base)",
    )
    IMAGE_MISSING = "image_missing", "image", False, "an image file or URL that is not there"
    IMAGE_UNREADABLE = "image_unreadable", "image", False, "an image that cannot be read or decoded"
    IMAGE_TOO_LARGE = (
        "image_too_large",
        "image",
        False,
        "an image input above max_bytes or max_pixels, or a generated image above 8192 x 8192 pixels (a decompression bomb)",
    )
    IMAGE_INVALID_VALUE = "image_invalid_value", "image", False, "an image input that is no path, URI, URL or image bytes"
    IMAGE_REMOTE_UNREACHABLE = "image_remote_unreachable", "image", False, "an image URL that cannot be fetched"
    # the engine
    CONTEXT_LENGTH = "context_length", "generate", True, "the prompt is too long for the model's context or KV cache"
    GRAMMAR_ERROR = "grammar_error", "generate", False, "the engine's JSON grammar failed on this request"
    ABORTED = "aborted", "generate", False, "the engine aborted the request"
    INVALID_REQUEST = "invalid_request", "generate", False, "the engine refused the request"
    IMAGE_UNSUPPORTED = "image_unsupported", "generate", False, "images sent to a model that is not a vision-language model"
    IMAGE_PLACEHOLDERS = "image_placeholders", "generate", False, "the prompt does not hold the model's image placeholder once per image"
    # the answer
    BAD_ANSWER = (
        "bad_answer",
        "generate",
        False,
        "the engine's or provider's answer holds a figure that cannot be used (a token count that is not a finite, non-negative integer)",
    )
    EMPTY_OUTPUT = "empty_output", "output", False, "the engine returned no text (reasoning only, or cut before any text)"
    REASONING_TRUNCATED = "reasoning_truncated", "output", True, "the length limit cut the answer while the model was still reasoning"
    JSON_PARSE = "json_parse", "output", False, "a JSON output's answer is not valid JSON"
    JSON_SCHEMA = "json_schema", "output", True, "a JSON output's answer does not match its schema (a greedy model answers the same again)"
    JSON_TRUNCATED = "json_truncated", "output", False, "a JSON answer cut off by max_new_tokens"
    # filter and custom steps
    FILTER_ERROR = "filter_error", "filter", False, "a filter predicate raised"
    FILTER_NOT_BOOL = "filter_not_bool", "filter", False, "a filter predicate gave something other than true or false"
    CUSTOM_ERROR = "custom_error", "custom", False, "a custom step's function raised (its message is kept)"
    CUSTOM_TIMEOUT = "custom_timeout", "custom", False, "a custom step's call ran past timeout_ms"
    CUSTOM_CRASHED = "custom_crashed", "custom", False, "a custom step's worker process died during the call"
    CUSTOM_BAD_VALUE = "custom_bad_value", "custom", False, "a custom step's function returned a value that is not JSON"
    # provider batch APIs (engines/batch_api.py): the provider's error codes, mapped
    CONTENT_FILTER = (
        "content_filter",
        "generate",
        False,
        "the provider's content policy (or a diffusers safety checker) refused the request or its image",
    )
    REQUEST_TOO_LARGE = (
        "request_too_large",
        "generate",
        True,
        "a request larger than a batch may hold (max_chunk_bytes, the provider's limit)",
    )
    RATE_LIMITED = "rate_limited", "generate", False, "the provider rate-limited the request inside its batch"
    PROVIDER_ERROR = (
        "provider_error",
        "generate",
        False,
        "the provider failed the request (a server error, an answer of an unexpected shape)",
    )
    BATCH_REJECTED = "batch_rejected", "generate", False, "the provider refused the whole batch (its reason is kept)"
    BATCH_EXPIRED = "batch_expired", "generate", False, "the batch expired before running the request, twice (it was resubmitted once)"
    BATCH_CANCELLED = (
        "batch_cancelled",
        "generate",
        False,
        "the batch was cancelled before running the request, twice (it was resubmitted once)",
    )
    # image generation (shard/steps/image.py, imagegen/)
    IMAGE_TIMEOUT = "image_timeout", "image output", False, "no image within the processor's timeout_seconds"
    IMAGE_UNDECODABLE = (
        "image_undecodable",
        "image output",
        False,
        "the answer is not an image Pillow can read (no data, bad base64, a broken file)",
    )
    IMAGE_GENERATION_FAILED = "image_generation_failed", "image output", False, "the image server or pipeline failed on this request"
    IMAGE_NAME_TAKEN = "image_name_taken", "image output", True, "filename_template names a file that exists and is not this row's image"
    IMAGE_NAME_REFUSED = (
        "image_name_refused",
        "image output",
        True,
        "filename_template gives a name the filesystem refuses (longer than 255 bytes, or an invalid name)",
    )
    # ours
    INTERNAL_ERROR = "internal_error", "row", False, "any other exception on the row's path (a bug of ours; the traceback is in the log)"


class EngineDeathClass(enum.StrEnum):
    """Why a launched inference server, or an in-process engine, stopped serving
    (``engine_deaths[].class`` in status.json, ``failure_class`` in failure.json), told from
    what can be seen: its exit code or signal, its log's last lines, its health probe; an
    in-process engine's exception (engines/server_process.classify_engine_error). The engine's
    death, not a row's: the job restarts the server (engines/server_restarts.py) or reloads
    the in-process engine, and the requests it held are sent again. An in-process transformers
    model out of memory is not reloaded (the same batch would run out again); in-process SGLang
    is (its scheduler sizes its batches), its class read from the job log
    (engines/server_process.classify_crash)."""

    def __new__(cls, value: str, meaning: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OUT_OF_MEMORY = "out_of_memory", "its log's last lines say it ran out of GPU or host memory (whatever its exit code)"
    KILLED_BY_SIGNAL = "killed_by_signal", "killed by a signal it did not handle (SIGKILL: the OOM killer, a person, the scheduler)"
    EXITED_WITH_ERROR = "exited_with_error", "it exited by itself during the run (a Python error, a failed check; its exit code is kept)"
    FROZEN = "frozen", "it answered neither a request nor its health probe for hang_seconds; the job killed its process tree"
    FAILED_TO_START = "failed_to_start", "a restart did not become healthy within server_start_timeout, or exited first"
    ENGINE_SERVICE_DIED = (
        "engine_service_died",
        (
            "the engine service of the shard's group (shards_per_engine) died or froze more often than its engine job "
            "replaces it (max_restarts), or stopped answering and was not replaced within hang_seconds and the restart "
            "wait (at once with hang_seconds: null), or died and no successor named itself in its endpoint file "
            "within $MIRAGEFLOW_ENGINE_RESTART_WAIT or was ready within $MIRAGEFLOW_ENGINE_WAIT"
        ),
    )
    DEVICE_ERROR = "device_error", "an in-process engine raised an error that leaves it unusable (a CUDA error, a device-side assert)"
    # not a death: the one other reason failure.json's failure_class names (transport/spend.py)
    BUDGET_EXCEEDED = "budget_exceeded", "no death: the run's spend reached execution_params.max_cost_usd; raise it and rerun to go on"


DETERMINISTIC_CLASSES = frozenset(c.value for c in RowErrorClass if c.deterministic)


def is_deterministic(kind: str) -> bool:
    """Whether a retry of a row failed with ``kind`` fails the same way (unknown classes: no)."""
    return kind in DETERMINISTIC_CLASSES


class RowError(MirageflowError):
    """One row (or sample) failed at one stage; the shard records it and goes on.

    ``kind`` must be a ``RowErrorClass`` (or its value): an unknown class is a bug, raised here.
    """

    def __init__(self, stage: str, kind: RowErrorClass, message: str, raw: str | None = None):
        self.stage, self.kind, self.raw = stage, RowErrorClass(kind), raw
        super().__init__(message)


def row_error_table() -> str:
    """The Markdown table of row error classes (docs/troubleshooting.md, between the row-errors markers)."""
    lines = ["| class | where | a retry | what |", "|---|---|---|---|"]
    for c in RowErrorClass:
        retry = "fails the same way" if c.deterministic else "may succeed"
        lines.append(f"| `{c.value}` | {c.stage} | {retry} | {c.meaning} |")
    return "\n".join(lines)


def death_class_table() -> str:
    """The Markdown table of engine death classes (docs/engines.md, between the death-classes markers)."""
    lines = ["| class | what |", "|---|---|"]
    lines += [f"| `{c.value}` | {c.meaning} |" for c in EngineDeathClass]
    return "\n".join(lines)
