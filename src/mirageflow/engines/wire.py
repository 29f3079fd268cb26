"""What travels between the runner and an engine: a Request, its Completion, and the
engine's EngineInfo (status.json -> engines). Plain data; the engine service
(cluster/engine_service.py) sends these fields over its HTTP protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    seed: int | None = None  # this request's sampling seed (mirageflow/prompts/samples.py); None: the engine's own randomness
    # mirageflow.prompts.images.CanonicalImage, one per {"type": "image"} part of the messages, in order
    images: list | None = None


@dataclass
class Completion:
    id: int
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length | abort
    error_kind: str | None = None  # set when the request could not run (e.g. context_length)
    error: str | None = None
    reasoning: str | None = None  # a server's reasoning_content, kept apart from text (the answer)
    image_tokens: int | None = None  # prompt tokens the images became, when the engine can tell


@dataclass
class EngineInfo:
    backend: str
    model_path: str
    versions: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    details: dict[str, Any] = field(default_factory=dict)
