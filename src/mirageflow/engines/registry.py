"""The backends a config can name, what each can do, and how ``backend: auto`` picks one.

``BACKENDS`` maps a name to a ``Backend``: where its engine class lives (imported only when
an engine is made) and its capabilities, so the config checks, the preflight, the preview
and the engine service ask ``capabilities(name)`` without importing an engine (every job
validates its config; an engine module and what it pulls in cost ~0.1 s). The engine
class declares the same capabilities as class attributes (engines/base.py ``Engine``);
tests/test_engine_registry.py checks that every registered class agrees with its line.

A new backend is one module (an ``Engine`` subclass taking ``(processor, batch_size,
log_dir=None)``; ``log_dir`` is where it may write logs of its own, None = a temporary
directory), one line here, and its name in the schema's ``processors[].backend`` enum.
"""

from __future__ import annotations

import enum
import importlib
import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from mirageflow.config.types import ProcessorConfig
    from mirageflow.engines.base import Engine

log = logging.getLogger(__name__)

AUTO = "auto"
SHARED = "shared"  # the client of an engine service (cluster/engine_service.py), not a config backend
SGLANG_INSTALL = "pip install -r requirements-gpu.txt (see docs/gpu-install.md)"
VLLM_INSTALL = "pip install vllm in the jobs' environment, or set server_command to a vLLM launcher (docs/vllm.md)"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the fields are ``Engine`` class attributes of the same names."""

    templates_server_side: bool = False  # the server applies the chat template (requests carry messages)
    native_n: bool = False  # one request with n answers a row's samples (processors[].native_n)
    loads_model: bool = True  # loads server_args.model_path on this node; False: a remote server has it
    needs_base_url: bool = False  # processors[].base_url is required
    grammar_in_process: bool = False  # JSON outputs constrained here by xgrammar (the driver checks it is installed)
    tokenizer_without_weights: bool = False  # Engine.key_tokenizer: the chat template without the weights (request cache keys)
    spans_nodes: bool = False  # one engine across the nodes of a job (execution_params.nodes > 1; engines/server_ranks.py)
    # requests go to a provider's API, which charges per token unless it is at a self-hosted address (stats/pricing.py)
    provider_api: bool = False

    @classmethod
    def of(cls, engine: type[Engine] | Engine) -> Capabilities:
        """The capabilities an engine class (or engine) declares."""
        return cls(**{f.name: getattr(engine, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Backend:
    target: str  # "module:Class", imported by engine_class
    can: Capabilities = field(default_factory=Capabilities)
    configurable: bool = True  # a value of processors[].backend; False: made by the workflow itself
    # The Python package the shard imports or launches (``python -m``) in the jobs'
    # environment, and how to install it; the driver checks it is there (config/preflight.py).
    package: str | None = None
    install: str = ""
    launched: bool = False  # processors[].server_command replaces the package's launcher


BACKENDS: dict[str, Backend] = {
    "transformers": Backend(
        "mirageflow.engines.transformers_engine:TransformersEngine", Capabilities(grammar_in_process=True, tokenizer_without_weights=True)
    ),
    "sglang": Backend("mirageflow.engines.sglang_engine:SGLangEngine", package="sglang", install=SGLANG_INSTALL),
    "sglang_server": Backend(
        "mirageflow.engines.sglang_server:SGLangServerEngine",
        Capabilities(spans_nodes=True),
        package="sglang",
        install=SGLANG_INSTALL,
        launched=True,
    ),
    # vLLM's OpenAI server launched on this node, fed through the openai client (chat messages, n)
    "vllm_server": Backend(
        "mirageflow.engines.vllm_server:VLLMServerEngine",
        Capabilities(templates_server_side=True, native_n=True, loads_model=True, needs_base_url=False, spans_nodes=True),
        package="vllm",
        install=VLLM_INSTALL,
        launched=True,
    ),
    "openai": Backend(
        "mirageflow.engines.openai_engine:OpenAIEngine",
        Capabilities(templates_server_side=True, native_n=True, loads_model=False, needs_base_url=True, provider_api=True),
    ),
    # processors of type batch_api (a provider's batch API; the builder sets this backend, not the user)
    "batch_api": Backend(
        "mirageflow.engines.batch_api:BatchApiEngine",
        Capabilities(templates_server_side=True, loads_model=False, provider_api=True),
        configurable=False,
    ),
    # the client of an engine service (execution_params.shards_per_engine); the service loaded the model
    SHARED: Backend("mirageflow.engines.shared:SharedEngine", Capabilities(loads_model=False), configurable=False),
}

# What ``auto`` can pick (select_backend), so what it can do whichever it picks.
AUTO_PICKS = ("sglang", "vllm_server", "transformers")


def config_backends() -> list[str]:
    """The names processors[].backend accepts (the schema's enum holds the same)."""
    return [AUTO, *(name for name, b in BACKENDS.items() if b.configurable)]


def capabilities(backend: str) -> Capabilities:
    """What a configured backend can do, without importing it. ``auto``: what it can do
    whichever backend it picks (a capability all picks have, a need any pick has)."""
    if backend != AUTO:
        return _backend(backend).can
    picks = [BACKENDS[name].can for name in AUTO_PICKS]
    return Capabilities(
        templates_server_side=all(c.templates_server_side for c in picks),
        native_n=all(c.native_n for c in picks),
        loads_model=all(c.loads_model for c in picks),
        needs_base_url=any(c.needs_base_url for c in picks),
        grammar_in_process=any(c.grammar_in_process for c in picks),
        tokenizer_without_weights=all(c.tokenizer_without_weights for c in picks),
        spans_nodes=all(c.spans_nodes for c in picks),
        provider_api=any(c.provider_api for c in picks),
    )


def backends_that(capable) -> list[str]:
    """Configurable backends whose capabilities satisfy ``capable(Capabilities)``, sorted (for messages)."""
    return sorted(name for name, b in BACKENDS.items() if b.configurable and capable(b.can))


def launches_server(backend: str) -> bool:
    """Whether a configured backend launches a server of its own (processors[].server_command and the other keys of
    ProcessorConfig.launch apply); ``auto``: whether one of its picks does."""
    names = AUTO_PICKS if backend == AUTO else (backend,)
    return any(_backend(name).launched for name in names)


def backends_that_launch() -> list[str]:
    """The configurable backends that launch a server, sorted (for messages)."""
    return sorted(name for name, b in BACKENDS.items() if b.configurable and b.launched)


def _backend(backend: str) -> Backend:
    try:
        return BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown backend '{backend}' (available: {', '.join(sorted(BACKENDS))})") from None


def backend_entry(backend: str) -> Backend:
    """A configured backend's line (not ``auto``: it picks what is installed)."""
    return _backend(backend)


def engine_class(backend: str) -> type[Engine]:
    module, _, name = _backend(backend).target.partition(":")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- backend: auto


class Reason(enum.Enum):
    """Why ``select_backend`` chose its backend."""

    CONFIGURED = "configured"
    GPU_AND_SGLANG = "gpu_and_sglang"  # sglang
    GPU_AND_VLLM = "gpu_and_vllm"  # vllm_server: a usable GPU, vllm installed, sglang not
    NO_GPU_ALLOCATED = "no_gpu_allocated"  # CUDA_VISIBLE_DEVICES is empty
    NO_NVIDIA_GPU = "no_nvidia_gpu"  # NVML sees none
    TORCH_CANNOT_USE_GPU = "torch_cannot_use_gpu"  # a CPU-only torch, or a driver too old for it
    SGLANG_MISSING = "sglang_missing"  # a usable GPU, but no sglang package

    @property
    def gpu_unused(self) -> bool:
        """A GPU is there but the chosen backend does not use it: worth a warning."""
        return self in (Reason.TORCH_CANNOT_USE_GPU, Reason.SGLANG_MISSING)


@dataclass(frozen=True)
class Selection:
    backend: str
    reason: Reason
    why: str  # the reason for a human (logs, status.json's backend_selection)


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


def select_backend(backend: str, environ: Mapping[str, str] | None = None) -> Selection:
    """The backend to run. ``auto`` -> sglang when the sglang package is installed and torch
    can use a GPU; vllm_server when vllm is installed there instead; else transformers; the
    reason says which check failed."""
    import importlib.util
    import os

    if backend != AUTO:
        return Selection(backend, Reason.CONFIGURED, "configured")
    environ = os.environ if environ is None else environ
    if environ.get("CUDA_VISIBLE_DEVICES") is not None and not environ["CUDA_VISIBLE_DEVICES"].strip():
        return Selection("transformers", Reason.NO_GPU_ALLOCATED, "no GPU allocated to this job (CUDA_VISIBLE_DEVICES is empty)")
    gpus, driver = _nvidia_gpus()
    has_sglang = importlib.util.find_spec("sglang") is not None
    usable, build = _torch_cuda()
    if has_sglang and usable:
        return Selection("sglang", Reason.GPU_AND_SGLANG, f"a CUDA GPU and the sglang package are present ({build})")
    if gpus == 0 and not usable:
        return Selection("transformers", Reason.NO_NVIDIA_GPU, "no NVIDIA GPU found (NVML sees none)")
    if not usable:
        return Selection("transformers", Reason.TORCH_CANNOT_USE_GPU, (
            f"the NVIDIA driver {driver} sees {gpus} GPU(s) but {build} cannot use them "
            "(a CPU-only torch, or a driver older than the torch build needs: sglang 0.5.23's "
            "torch 2.14.1 is built for CUDA 13 and needs driver >= 580)"
        ))  # fmt: skip
    if importlib.util.find_spec("vllm") is not None:
        return Selection("vllm_server", Reason.GPU_AND_VLLM, f"a CUDA GPU and the vllm package are present, sglang is not ({build})")
    return Selection(
        "transformers", Reason.SGLANG_MISSING,
        f"a GPU is usable but neither the sglang nor the vllm package is installed ({SGLANG_INSTALL})",
    )  # fmt: skip


def resolve_backend(backend: str) -> str:
    return select_backend(backend).backend


def create_engine(processor: ProcessorConfig, batch_size: int, log_dir=None) -> Engine:
    chosen = select_backend(processor.backend)
    cls = engine_class(chosen.backend)
    if processor.backend == AUTO:
        (log.warning if chosen.reason.gpu_unused else log.info)("backend auto -> %s: %s", chosen.backend, chosen.why)
    engine = cls(processor, batch_size, log_dir=log_dir)
    engine.backend_selection = {"requested": processor.backend, "chosen": chosen.backend, "reason": chosen.why}
    return engine
