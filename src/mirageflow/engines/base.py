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
import json
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


# --------------------------------------------------------------------------- chat templates


def _chat_template_env():
    """A Jinja2 environment that renders chat templates as transformers does.

    Same settings as ``transformers.utils.chat_template_utils._compile_jinja_template``:
    sandboxed, trim_blocks/lstrip_blocks, loop controls, a ``tojson`` that does not escape
    HTML, ``raise_exception`` and ``strftime_now``, and ``{% generation %}`` blocks (which
    render their body; the tracker transformers attaches to them is off for text output).
    """
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_CHAT_ENV = None


class ChatTemplate:
    """``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)``
    with the template compiled once.

    transformers spends most of each call on bookkeeping around the render (~80 us per
    row); this renders the same compiled template with the same variables (the
    tokenizer's special tokens, ``tools``/``documents`` None, the kwargs) and yields the
    same text (tests/test_fast_paths.py checks several templates). It falls back to the
    tokenizer's own method when exactness is not certain: a tokenizer class with its own
    ``apply_chat_template``, a template that does not compile, or kwargs that are
    parameters of ``apply_chat_template`` itself (``tools``, ``continue_final_message``...).
    The special tokens are read once, at construction.
    """

    def __init__(self, tokenizer):
        global _CHAT_ENV
        self.tokenizer = tokenizer
        self._template = None
        try:
            import inspect

            from transformers import PreTrainedTokenizerBase

            cls = type(tokenizer)
            if cls.apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template or not isinstance(tokenizer, PreTrainedTokenizerBase):
                return
            source = tokenizer.get_chat_template()
            if not isinstance(source, str):
                return
            if _CHAT_ENV is None:
                _CHAT_ENV = _chat_template_env()
            from mirageflow.prompts import fast_renderer

            self._template = _CHAT_ENV.from_string(source)
            self._render = fast_renderer(self._template)
            self._reserved = frozenset(inspect.signature(cls.apply_chat_template).parameters) | {"messages"}
            self._base = {**tokenizer.special_tokens_map, "tools": None, "documents": None, "add_generation_prompt": True}
        except Exception:  # no transformers, no template, a template that does not compile: the slow path
            self._template = None

    def __call__(self, messages: list[dict[str, str]], kwargs: dict | None = None) -> str:
        if self._template is None or not messages or (kwargs and not self._reserved.isdisjoint(kwargs)):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
        if kwargs:
            return self._render({**self._base, **kwargs, "messages": messages})
        return self._render({**self._base, "messages": messages})


class Engine(abc.ABC):
    """Load once, apply the model's chat template, generate request by request, close."""

    info: EngineInfo
    max_inflight: int = 64  # rows the runner keeps in flight; engines set it from their capacity

    @abc.abstractmethod
    def load(self) -> None: ...

    def chat_prompt(self, messages: list[dict[str, str]], chat_template_kwargs: dict) -> str:
        """The model input for chat messages, through the model's own chat template.

        Default: ``self.tokenizer``'s template compiled once (``ChatTemplate``), the same
        text as ``tokenizer.apply_chat_template(messages, tokenize=False,
        add_generation_prompt=True, **chat_template_kwargs)`` at a fraction of its per-call
        cost. Engines without a Hugging Face tokenizer override this.
        """
        template = self.__dict__.get("_chat_template")
        if template is None:
            tokenizer = getattr(self, "tokenizer", None)
            if tokenizer is None:
                raise NotImplementedError(f"{type(self).__name__} has no tokenizer to apply a chat template with")
            template = self._chat_template = ChatTemplate(tokenizer)
        return template(messages, chat_template_kwargs)

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


def _transformers(processor, batch_size: int, log_dir=None) -> Engine:
    from mirageflow.engines.transformers_engine import TransformersEngine

    return TransformersEngine(processor.server_args, batch_size=batch_size, torch_threads=processor.torch_threads)


def _sglang(processor, batch_size: int, log_dir=None) -> Engine:
    from mirageflow.engines.sglang_engine import SGLangEngine

    return SGLangEngine(processor, batch_size, log_dir=log_dir)


def _sglang_server(processor, batch_size: int, log_dir=None) -> Engine:
    from mirageflow.engines.sglang_server import SGLangServerEngine

    return SGLangServerEngine(processor, batch_size, log_dir=log_dir)


def _openai(processor, batch_size: int, log_dir=None) -> Engine:
    from mirageflow.engines.openai_engine import OpenAIEngine

    return OpenAIEngine(processor, batch_size, log_dir=log_dir)


# backend name -> factory(processor, batch_size, log_dir=None); engines import their heavy
# libraries lazily inside. log_dir: where an engine may write logs of its own (the
# sglang_server's server log); None = a temporary directory.
BACKENDS = {
    "transformers": _transformers,
    "sglang": _sglang,
    "sglang_server": _sglang_server,
    "openai": _openai,
}


def create_engine(processor, batch_size: int, log_dir=None) -> Engine:
    backend = resolve_backend(processor.backend)
    if backend not in BACKENDS and processor.backend == "auto":
        log.warning("backend auto: %s is not available in this version; using transformers", backend)
        backend = "transformers"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}' (available: {', '.join(sorted(BACKENDS))})")
    return BACKENDS[backend](processor, batch_size, log_dir=log_dir)
