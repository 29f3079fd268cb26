"""Hugging Face transformers engine: the CPU default, and one CUDA GPU with continuous batching.

On CUDA (``extra_engine_args.continuous_batching``: ``auto``, the default) the requests it
can serve go to transformers' own continuous-batching manager (paged KV cache; a finished
row frees its slot at once): transformers_cb.py says which ones and why the others (JSON
outputs, stop strings, seeded sampling, images, ...) stay on the static path
(transformers_static.py forms its batches, transformers_generate.py runs them), and
``engines.<name>.details.continuous_batching`` in status.json counts each. On the CPU the
static path serves everything unless ``continuous_batching: true`` (BENCHMARKS.md section
``transformers_cb`` measures both there).

This class loads the model, routes each request to its path and reloads the model after an
error that leaves it unusable (a device error: model_reloads.py, one mechanism for both
paths): up to ``max_restarts`` times, then EngineDied with its class; out of memory is not
reloaded. A reload rebuilds the continuous-batching manager on the new model; each path
sends again only what was not answered yet (the static path the rows of its batch not handed
back, the manager's path the requests it held).
"""

from __future__ import annotations

import gc
import logging
import os
import threading

from mirageflow.config.types import ProcessorConfig, ServerArgs
from mirageflow.engines.base import Engine, EngineError, EngineStopped
from mirageflow.engines.batch_time import BatchTimeCap
from mirageflow.engines.model_reloads import ModelReloads
from mirageflow.engines.server_restarts import DEFAULT_MAX_RESTARTS
from mirageflow.engines.tokens import PromptTokenizer
from mirageflow.engines.transformers_generate import DEFAULT_MAX_NEW_TOKENS, BatchGenerator, too_long
from mirageflow.engines.transformers_static import StaticBatcher
from mirageflow.engines.wire import Completion, EngineInfo, Request

log = logging.getLogger(__name__)

_ENGINE_ARGS = {"dtype", "attn_implementation", "continuous_batching", "max_running_requests"}


def default_threads(requested: int | None) -> int:
    if requested:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Small models on 2-core machines run ~10x slower, and erratically, with 2 threads.
    return 1 if cpus <= 2 else cpus


class TransformersEngine(Engine):
    grammar_in_process = True  # JSON outputs through xgrammar token masks (engines/registry.py)
    tokenizer_without_weights = True  # key_tokenizer: the request cache's stand-in (shard/cached_answers.py)

    @staticmethod
    def key_tokenizer(server_args):
        return load_tokenizer(server_args)[1]

    def __init__(self, processor: ProcessorConfig | ServerArgs, batch_size: int = 32, torch_threads: int | None = None, log_dir=None):
        """``processor``: a ProcessorConfig (what create_engine passes), or its server_args."""
        if isinstance(processor, ProcessorConfig):
            server_args, sampling = processor.server_args, processor.sampling_params
            torch_threads = torch_threads or processor.torch_threads
            max_restarts = processor.max_restarts
        else:
            server_args, sampling = processor, {}
            max_restarts = DEFAULT_MAX_RESTARTS
        self.server_args = server_args
        self.batch_size = batch_size
        self.max_inflight = 2 * batch_size
        self.threads = default_threads(torch_threads)
        self.model = self.tokenizer = None
        self.stopped = threading.Event()
        self.reloads = ModelReloads(max_restarts, self._reload, self.stopped)  # device errors reload the model in the job
        self.generator = BatchGenerator(self)  # runs the static path's batches
        self._static = StaticBatcher(self)  # forms them
        self._cb = None  # transformers_cb.ContinuousBatcher when continuous batching is on
        self.cap = BatchTimeCap(batch_size, None)  # sized at load(), from the runner's commit_seconds
        self.default_params = dict(sampling or {})
        self.info = EngineInfo(backend="transformers", model_path=server_args.model_path)

    @property
    def max_restarts(self) -> int:
        return self.reloads.max_restarts

    # ------------------------------------------------------------------ setup

    def warmup(self) -> None:
        if self._cb is not None:
            self._cb.warmup()

    def load(self) -> None:
        import torch
        import transformers

        torch.set_num_threads(self.threads)
        extra = dict(self.server_args.extra_engine_args)
        ignored = sorted(set(extra) - _ENGINE_ARGS)
        if ignored:
            log.info("transformers engine ignores extra_engine_args %s (SGLang options)", ignored)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # bf16 on GPU; float32 on CPU, where bf16 matmuls are slow without AMX.
        dtype = extra.get("dtype") or ("bfloat16" if device == "cuda" else "float32")
        path = self.server_args.model_path
        self.processor, self.tokenizer = load_tokenizer(self.server_args)
        self._prompt_ids = PromptTokenizer(self.tokenizer)  # exactly one BOS when the tokenizer adds one
        self._load_model(device, dtype, extra)
        self._reload_args = (device, dtype, extra)
        self.info = EngineInfo(
            backend="transformers",
            model_path=path,
            versions={"transformers": transformers.__version__, "torch": torch.__version__},
            device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            details={"dtype": dtype, "torch_threads": self.threads, "batch_size": self.batch_size, "max_restarts": self.max_restarts},
        )
        self.cap = BatchTimeCap(self.batch_size, self.commit_seconds)
        self.info.details["batch_time"] = self.cap.details()
        self._start_continuous_batching(extra.get("continuous_batching", "auto"), extra.get("max_running_requests"))
        self._static.start()

    def _load_model(self, device: str, dtype: str, extra: dict) -> None:
        """The weights, on ``device`` (load, and a reload after a device error: ``_reload``)."""
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": self.server_args.trust_remote_code}
        if "attn_implementation" in extra:
            kwargs["attn_implementation"] = extra["attn_implementation"]
        model_class = AutoModelForCausalLM if self.processor is None else transformers.AutoModelForImageTextToText
        self.model = model_class.from_pretrained(self.server_args.model_path, **kwargs).to(device).eval()
        self.device = device
        config = self.model.config
        self.max_context = getattr(config, "max_position_embeddings", None) or getattr(
            getattr(config, "text_config", None), "max_position_embeddings", None
        )
        self.eos_ids = self._eos_ids()

    def _start_continuous_batching(self, mode, running) -> None:
        """Build the continuous-batching manager when ``mode`` (auto: on CUDA) asks for it."""
        from mirageflow.engines.transformers_cb import start

        self._cb, self.info.details["continuous_batching"] = start(self, mode, running)
        if self._cb is not None:
            self.max_inflight = 2 * self._cb.running  # as SGLang's: the manager always has the next requests queued
            self.warms_up = True  # this instance does (CUDA graphs): the runner times warmup() as its phase

    def _eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _reload(self) -> None:
        """The model loaded again after a device error (ModelReloads calls it, its lock held), and
        the continuous-batching manager rebuilt on it: the requests the old manager still held
        fail with an error that sends them again (their generation is replaced)."""
        import torch

        old = self._cb
        if old is not None:
            old.close(EngineError("the continuous batching manager is rebuilt on the reloaded model"))
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._load_model(*self._reload_args)
        if old is not None:
            self._cb = old.rebuilt(self.model)

    def restarts(self) -> int:
        return self.reloads.count

    def deaths(self) -> list[dict]:
        return self.reloads.listing()

    # ------------------------------------------------------------------ requests

    async def generate_one(self, request: Request) -> Completion:
        if self.stopped.is_set():
            raise EngineStopped("engine was stopped")
        if self._cb is not None:
            from mirageflow.engines.transformers_cb import static_reason

            params = request.sampling_params
            reason = static_reason(request, params, self._cb.sampler)
            if reason is None:
                return await self._generate_continuous(request, params)
            self._cb.served_statically(reason)
        return await self._static.generate(request)

    async def _generate_continuous(self, request: Request, params: dict) -> Completion:
        self.generator.warn_unsupported(params)
        prompt_ids = self._prompt_ids(request.prompt)
        limit = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if self.max_context and len(prompt_ids) + limit > self.max_context:
            return too_long(request.id, len(prompt_ids), limit, self.max_context)
        cb = self._cb  # the one this attempt sends to (a reload replaces it)

        async def attempt() -> Completion:
            nonlocal cb
            cb = self._cb
            return await cb.generate(request, prompt_ids, params, limit)

        return await self.reloads.run_one(attempt, lambda error: cb.cause(error))

    def queue_depth(self) -> int:
        return self._static.depth() + (self._cb.depth() if self._cb is not None else 0)

    def stop(self) -> None:
        self.stopped.set()
        if self._cb is not None:
            self._cb.fail_all(EngineStopped("engine was stopped"))

    def close(self) -> None:
        self.stopped.set()
        if self._cb is not None:
            self._cb.close()
            self._cb = None
        self._static.close()


def load_tokenizer(server_args: ServerArgs) -> tuple:
    """(the vision processor or None, the tokenizer) of the model at ``server_args.model_path``,
    as the engine uses them: what its chat template needs, without the weights (also the
    request cache's stand-in engine's, shard/cached_answers.py). A vision-language model's
    processor (images -> pixels, placeholders expanded) brings its tokenizer."""
    from transformers import AutoTokenizer

    path, trust = server_args.model_path, server_args.trust_remote_code
    processor = _vision_processor(path, trust)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust) if processor is None else processor.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor, tokenizer


def _vision_processor(path: str, trust: bool):
    """The processor of a local vision-language model (config.json declares a vision tower), else None."""
    from mirageflow import model_config

    if not model_config.is_vision(path):
        return None
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{path}: a vision model, but its processor ({type(processor).__name__}) has no tokenizer and image processor")
    return processor
