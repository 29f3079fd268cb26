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
import dataclasses
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
            from mirageflow.prompts.templates import fast_renderer

            self._template = _CHAT_ENV.from_string(source)
            self._source = source
            self._render = fast_renderer(self._template)
            self._reserved = frozenset(inspect.signature(cls.apply_chat_template).parameters) | {"messages"}
            self._base = {**tokenizer.special_tokens_map, "tools": None, "documents": None, "add_generation_prompt": True}
        except Exception:  # no transformers, no template, a template that does not compile: the slow path
            self._template = None

    def spec(self) -> dict | None:
        """What renders the same text in another process (engines/shared.py); None without the fast path."""
        if self._template is None:
            return None
        return {"source": self._source, "base": self._base, "reserved": sorted(self._reserved)}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer) -> "ChatTemplate":
        """The template of ``spec()``; ``tokenizer`` only needs ``apply_chat_template`` (the slow path)."""
        global _CHAT_ENV
        from mirageflow.prompts.templates import fast_renderer

        if _CHAT_ENV is None:
            _CHAT_ENV = _chat_template_env()
        self = cls.__new__(cls)
        self.tokenizer, self._source = tokenizer, spec["source"]
        self._template = _CHAT_ENV.from_string(spec["source"])
        self._render = fast_renderer(self._template)
        self._reserved, self._base = frozenset(spec["reserved"]), dict(spec["base"])
        return self

    def __call__(self, messages: list[dict[str, str]], kwargs: dict | None = None) -> str:
        if self._template is None or not messages or (kwargs and not self._reserved.isdisjoint(kwargs)):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
        if kwargs:
            return self._render({**self._base, **kwargs, "messages": messages})
        return self._render({**self._base, "messages": messages})


class Engine(abc.ABC):
    """Load once, apply the model's chat template, generate request by request, close."""

    max_inflight: int = 64  # rows the runner keeps in flight; engines set it from their capacity
    # how create_engine chose this backend ({"requested", "chosen", "reason"}); shown in
    # info.details["backend_selection"] (status.json -> engines)
    backend_selection: dict | None = None

    @property
    def info(self) -> EngineInfo:
        info = self.__dict__["_info"]
        if self.backend_selection and "backend_selection" not in info.details:
            info.details["backend_selection"] = dict(self.backend_selection)
        return info

    @info.setter
    def info(self, value: EngineInfo) -> None:
        self.__dict__["_info"] = value

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

    async def generate_samples(self, request: Request, n: int) -> list[Completion]:
        """``n`` samples of one request (n_samples: consecutive samples of one row), sample k
        with id ``request.id + k`` and seed ``request.seed + k``. Here: n requests at once.
        Engines with native ``n`` (one request, n choices) override this."""
        if n == 1:
            return [await self.generate_one(request)]
        return list(
            await asyncio.gather(
                *(
                    self.generate_one(dataclasses.replace(request, id=request.id + k, seed=None if request.seed is None else request.seed + k))
                    for k in range(n)
                )
            )
        )

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



# --------------------------------------------------------------------------- errors


class EngineError(RuntimeError):
    """The engine cannot go on (it crashed, the server died, the endpoint is unusable): the
    shard fails with this message. Row-level problems are Completions with ``error_kind``."""


class EngineStopped(EngineError):
    """``stop()`` was called (SIGTERM/SIGINT): outstanding and later requests fail with it."""


# --------------------------------------------------------------------------- prompt tokens


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` (add_special_tokens=True, what SGLang does with a text
    prompt) puts the BOS token in front."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer without the call: assume not
        return False
    return bool(ids) and ids[0] == bos


def prompt_token_ids(tokenizer, text: str, bos: int | None) -> list[int]:
    """The model input's token ids, with exactly one BOS when ``bos`` is the id the
    tokenizer adds (``adds_bos``), and none added otherwise.

    A rendered chat template usually starts with the BOS already (Llama 3, Gemma, Mistral,
    DeepSeek); SGLang tokenizes text prompts with ``add_special_tokens=True``, which adds
    a second one. Engines therefore tokenize here with ``add_special_tokens=False``, put
    one BOS in front when the text has none (a raw prompt, ``apply_chat_template:
    false``), drop repeats of it, and send the ids.
    """
    return _one_bos(list(tokenizer(text, add_special_tokens=False)["input_ids"]), bos)


def _one_bos(ids: list[int], bos: int | None) -> list[int]:
    if bos is None:
        return ids
    start = 0
    while start < len(ids) and ids[start] == bos:
        start += 1
    return [bos, *ids[start:]]


class PromptTokenizer:
    """``prompt_token_ids`` with the tokenizer's BOS behaviour read once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None

    def __call__(self, text: str) -> list[int]:
        return prompt_token_ids(self.tokenizer, text, self.bos)

    def batch(self, texts: list[str]) -> list[list[int]]:
        """Several prompts in one tokenizer call."""
        return [_one_bos(list(ids), self.bos) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------- backends

# Backend name -> "module:Class", imported only when chosen. A class takes
# (processor, batch_size, log_dir=None); log_dir is where it may write logs of its own (the
# sglang_server's server log; None = a temporary directory). A new backend is one module
# and one line here.
BACKENDS = {
    "transformers": "mirageflow.engines.transformers_engine:TransformersEngine",
    "sglang": "mirageflow.engines.sglang_engine:SGLangEngine",
    "sglang_server": "mirageflow.engines.sglang_server:SGLangServerEngine",
    "openai": "mirageflow.engines.openai_engine:OpenAIEngine",
    # not a config backend: the client of an engine service (execution_params.shards_per_engine)
    "shared": "mirageflow.engines.shared:SharedEngine",
}

SGLANG_INSTALL = "pip install -r requirements-gpu.txt (see the README's GPU section)"


def engine_class(backend: str) -> type[Engine]:
    import importlib

    try:
        target = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown backend '{backend}' (available: {', '.join(sorted(BACKENDS))})") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _nvidia_gpus() -> tuple[int, str | None]:
    """(GPUs the NVIDIA driver sees, driver version), through NVML; (0, None) without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            return pynvml.nvmlDeviceGetCount(), driver.decode() if isinstance(driver, bytes) else str(driver)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library
        return 0, None


def _torch_cuda() -> tuple[bool, str]:
    """(torch can use CUDA, a description of the torch build)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    cuda = getattr(torch.version, "cuda", None)
    build = f"torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU-only build'})"
    try:
        return bool(torch.cuda.is_available()), build
    except Exception as e:  # noqa: BLE001
        return False, f"{build}: {type(e).__name__}: {e}"


def cuda_available() -> bool:
    return _torch_cuda()[0]


def select_backend(backend: str, environ=None) -> tuple[str, str]:
    """(backend, why). ``auto`` -> sglang when the sglang package is installed and torch can
    use a GPU, else transformers; the reason says which check failed."""
    import importlib.util
    import os

    if backend != "auto":
        return backend, "configured"
    environ = os.environ if environ is None else environ
    if environ.get("CUDA_VISIBLE_DEVICES") is not None and not environ["CUDA_VISIBLE_DEVICES"].strip():
        return "transformers", "no GPU allocated to this job (CUDA_VISIBLE_DEVICES is empty)"
    gpus, driver = _nvidia_gpus()
    has_sglang = importlib.util.find_spec("sglang") is not None
    usable, build = _torch_cuda()
    if has_sglang and usable:
        return "sglang", f"a CUDA GPU and the sglang package are present ({build})"
    if gpus == 0 and not usable:
        return "transformers", "no NVIDIA GPU found (NVML sees none)"
    if not usable:
        return "transformers", (
            f"the NVIDIA driver {driver} sees {gpus} GPU(s) but {build} cannot use them "
            "(a CPU-only torch, or a driver older than the torch build needs: sglang 0.5.23's "
            "torch 2.14.1 is built for CUDA 13 and needs driver >= 580)"
        )
    return "transformers", f"a GPU is usable but the sglang package is not installed ({SGLANG_INSTALL})"


def resolve_backend(backend: str) -> str:
    return select_backend(backend)[0]


def create_engine(processor, batch_size: int, log_dir=None) -> Engine:
    backend, why = select_backend(processor.backend)
    cls = engine_class(backend)
    if processor.backend == "auto":
        gpu_wasted = backend != "sglang" and not why.startswith(("no NVIDIA GPU", "no GPU allocated"))
        (log.warning if gpu_wasted else log.info)("backend auto -> %s: %s", backend, why)
    engine = cls(processor, batch_size, log_dir=log_dir)
    engine.backend_selection = {"requested": processor.backend, "chosen": backend, "reason": why}
    return engine
