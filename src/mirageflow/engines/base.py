"""The engine interface every backend implements, and backend selection.

The shard runner keeps up to ``max_inflight`` rows in flight and awaits one
``generate_one`` per request, so an engine is never drained between batches: a
continuous-batching engine (SGLang, an HTTP server) takes each request as it comes, and a
batched engine (transformers) groups whatever is waiting. ``generate`` is a synchronous
convenience for tests and benchmarks.
"""

from __future__ import annotations

import abc
import asyncio
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger(__name__)


@dataclass
class Request:
    id: int
    messages: list[dict[str, str]] | None  # chat messages, templated by the engine
    prompt: str | None  # or fully formatted model input
    sampling_params: dict[str, Any]
    json_schema: str | None = None  # for engines with constrained decoding


@dataclass
class Completion:
    id: int
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length | abort
    error_kind: str | None = None  # set when the request could not run (e.g. context_length)
    error: str | None = None


@dataclass
class EngineInfo:
    backend: str
    model_path: str
    versions: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    details: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """Load once, apply the model's chat template, generate request by request, close."""

    info: EngineInfo
    max_inflight: int = 64  # rows the runner keeps in flight; engines set it from their capacity

    @abc.abstractmethod
    def load(self) -> None: ...

    @abc.abstractmethod
    def chat_prompt(self, messages: list[dict[str, str]], chat_template_kwargs: dict) -> str:
        """The model input for chat messages, through the model's own chat template."""

    @abc.abstractmethod
    async def generate_one(self, request: Request) -> Completion:
        """Generate one request; called concurrently, up to max_inflight at a time."""

    def queue_depth(self) -> int | None:
        """Requests waiting or running inside the engine, when it can tell."""
        return None

    def stop(self) -> None:  # noqa: B027 - engines without long calls have nothing to interrupt
        """Interrupt running generation soon (called on SIGTERM/SIGINT, from any thread)."""

    def close(self) -> None:  # noqa: B027 - optional for engines without resources
        pass

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """All requests at once, in input order (tests, benchmarks)."""

        async def run():
            return await asyncio.gather(*(self.generate_one(r) for r in requests))

        return list(asyncio.run(run()))

    def __enter__(self):
        self.load()
        return self

    def __exit__(self, *exc):
        self.close()


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(backend: str) -> str:
    """`auto` -> sglang when a CUDA GPU and the sglang package are present, else transformers."""
    if backend != "auto":
        return backend
    if importlib.util.find_spec("sglang") is not None and cuda_available():
        return "sglang"
    return "transformers"


def _transformers(processor, batch_size: int) -> Engine:
    from mirageflow.engines.transformers_engine import TransformersEngine

    return TransformersEngine(processor.server_args, batch_size=batch_size, torch_threads=processor.torch_threads)


# backend name -> factory; engines import their heavy libraries lazily inside.
BACKENDS = {"transformers": _transformers}


def create_engine(processor, batch_size: int) -> Engine:
    backend = resolve_backend(processor.backend)
    if backend not in BACKENDS and processor.backend == "auto":
        log.warning("backend auto: %s is not available in this version; using transformers", backend)
        backend = "transformers"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}' (available: {', '.join(sorted(BACKENDS))})")
    return BACKENDS[backend](processor, batch_size)
