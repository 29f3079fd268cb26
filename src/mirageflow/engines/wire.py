"""What travels between the runner and an engine: a Request, its Completion, and the
engine's EngineInfo (status.json -> engines). Plain data; the engine service
(cluster/engine_service.py) sends these fields over its HTTP protocol."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from mirageflow.errors import MirageflowError, RowErrorClass


@dataclass
class Request:
    id: int
    messages: list[dict[str, str]] | None  # chat messages, templated by the engine
    prompt: str | None  # or fully formatted model input
    sampling_params: dict[str, Any]
    json_schema: str | None = None  # for engines with constrained decoding
    # The answer's start (output response_prefix). A ``prompt`` already ends with it; with
    # ``messages`` only, the engine sends it as a last assistant message to continue. Only
    # the continuation is generated, so a JSON grammar starts after it.
    response_prefix: str = ""
    seed: int | None = None  # this request's sampling seed (mirageflow/shard/samples.py); None: the engine's own randomness
    # mirageflow.prompts.images.CanonicalImage, one per {"type": "image"} part of the messages, in order
    images: list | None = None


def text_chars(content) -> int:
    """Characters of a message's text (a string, or OpenAI's content parts' text)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def prompt_chars(request: Request, messages: bool = True) -> int:
    """Characters of what a request sends (the input of its token and cost estimate,
    transport/rate_limit.estimate_tokens): its messages' text and response prefix, or its
    prompt when it has no messages or ``messages`` is false (a prompt templated here)."""
    if request.messages is not None and (messages or request.prompt is None):
        return sum(text_chars(m.get("content")) for m in request.messages) + len(request.response_prefix or "")
    return len(request.prompt or "")


@dataclass
class Completion:
    id: int
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length | abort
    # set when the request could not run (e.g. context_length): a RowErrorClass (a StrEnum, so
    # JSON and comparisons see its name); a string given here is made one, an unknown name raises
    error_kind: RowErrorClass | None = None
    error: str | None = None
    reasoning: str | None = None  # a server's reasoning_content, kept apart from text (the answer)
    image_tokens: int | None = None  # prompt tokens the images became, when the engine can tell
    cached_tokens: int = 0  # prompt tokens the provider read from its prompt cache (priced apart: stats/pricing.py)

    def __post_init__(self) -> None:
        if self.error_kind is not None and self.error_kind.__class__ is not RowErrorClass:
            self.error_kind = RowErrorClass(self.error_kind)  # ValueError for a class nobody knows: a bug, where it is made


@dataclass
class EngineInfo:
    backend: str
    model_path: str
    versions: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    details: dict[str, Any] = field(default_factory=dict)


class BadAnswer(MirageflowError, ValueError):
    """An answer holds a figure that cannot be used (a token count that is not a finite,
    non-negative integer): the row of that answer fails as ``bad_answer``, never the shard."""


def token_count(value: Any, what: str) -> int:
    """A server's or provider's token figure as a count: absent (None) is 0; an int, or a
    float with an integral value, that is finite and not negative is itself; anything else
    (``1e999`` reads as inf, NaN, -12000, "12", true) raises BadAnswer naming ``what``."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadAnswer(f"{what} is {str(value)[:40]!r}, not a number")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise BadAnswer(f"{what} is {value!r}, not a finite whole number")
    if value < 0:
        raise BadAnswer(f"{what} is {value!r}, a negative count")
    return int(value)


def usage_counts(usage: Any, prompt_key: str, completion_key: str, where: str = "usage") -> tuple[int, int]:
    """(prompt tokens, completion tokens) of an answer's usage object, each a ``token_count``;
    a usage that is not an object raises BadAnswer. The one place that turns token numbers
    an engine or provider reports into counts (batch providers, the OpenAI-compatible
    engine, SGLang's meta_info)."""
    if usage is None:
        return 0, 0
    if not isinstance(usage, Mapping):
        raise BadAnswer(f"{where} is a {type(usage).__name__}, not an object")
    return (
        token_count(usage.get(prompt_key), f"{where}.{prompt_key}"),
        token_count(usage.get(completion_key), f"{where}.{completion_key}"),
    )
