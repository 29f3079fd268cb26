"""Continuous batching for the transformers engine: transformers' own generation manager.

``model.init_continuous_batching`` (transformers 5.x, ``generation/continuous_batching``)
runs a background thread that keeps a paged KV cache and schedules every request it holds
into each forward step: a row that ends (its EOS, its ``max_new_tokens``) frees its slot at
once, and a waiting one takes it, instead of a static batch decoding until its longest row
is done. The transformers engine sends it the requests it can serve and keeps its static
``generate`` batches for the others (:func:`static_reason`):

- a JSON output (xgrammar per-row token masks: the manager applies one processor list to
  every request), stop strings (no stop strings in the manager), a seeded sampling request
  (the manager has one random generator), ``min_new_tokens``, ``repetition_penalty``,
  ``min_p`` (processors the manager drops or may not support), images (the manager feeds
  token ids only), and sampling parameters other than the processor's defaults (the
  manager samples every request with the temperature/top_p/top_k it was built with).

The manager is built once, at load, from the processor's default sampling parameters. It
gets its own module tree sharing the model's weights (no copy of the weights): transformers
5.17 switches the model's attention to ``paged|sdpa`` while the manager runs, and a static
``generate`` on that attention fails, so the static path keeps the original modules.

Results come back through ``manager.get_result`` on a collector thread, which resolves each
request's future on its event loop; a request the manager fails (or a manager that dies)
raises :class:`EngineError` in its caller. When the manager died of an error that leaves the
model unusable (a device error: the manager records it, :meth:`ContinuousBatcher.cause`) the
engine reloads the model through its one ModelReloads (model_reloads.py, as the static path
does), builds a new manager on it (:meth:`ContinuousBatcher.rebuilt`) and sends again the
requests the dead one held; any other failure fails the shard as any engine error does.
Used by transformers_engine.py only.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import math
import threading
import time

from mirageflow.engines.base import Completion, EngineError, EngineStopped, Request
from mirageflow.engines.server_process import classify_engine_error
from mirageflow.engines.transformers_static import deliver

log = logging.getLogger(__name__)

# Sampling params the manager applies as the static path does (the rest decide the route).
_SAMPLER_KEYS = ("temperature", "top_p", "top_k")
# Features the manager does not have: a request using one is served by the static path.
_STATIC_ONLY = {
    "stop": lambda v: bool(v),
    "min_new_tokens": lambda v: bool(v),
    "repetition_penalty": lambda v: v not in (None, 1, 1.0),
    "min_p": lambda v: bool(v),
}
DEFAULT_RUNNING_CUDA = 256  # requests decoding at once on a GPU when max_running_requests is unset
_CPU_TOKENS_PER_REQUEST = 1024  # CPU KV cache: pages for this many tokens per running request
_COLLECT_TIMEOUT = 0.2  # seconds the collector waits for a result before checking the manager is alive
_DEATH_SECONDS = 30.0  # how long a request failed by the manager's death waits for its thread to record why


def sampler(params: dict) -> tuple:
    """What the manager's sampling depends on: (temperature, top_p, top_k), normalised (greedy: one key)."""
    temperature = params.get("temperature", 1.0)  # SGLang's default, as the static path
    if not temperature or temperature <= 0:
        return ("greedy",)
    top_k = params.get("top_k", -1)
    return (float(temperature), float(params.get("top_p", 1.0) or 1.0), int(top_k) if top_k and top_k > 0 else -1)


def static_reason(request: Request, params: dict, manager_sampler: tuple) -> str | None:
    """Why ``request`` cannot go to the manager (then the static path serves it), else None."""
    if request.images:
        return "images"
    if request.json_schema is not None:
        return "json_schema"
    for name, used in _STATIC_ONLY.items():
        if used(params.get(name)):
            return name
    mine = sampler(params)
    if mine != manager_sampler:
        return "sampling_params"
    if mine != ("greedy",) and request.seed is not None:
        return "seed"
    return None


def manager_config(running: int, device: str, max_context: int | None) -> dict:
    """The ContinuousBatchingConfig fields we set (names common to transformers 5.17 and 5.19)."""
    config = {"max_requests_per_batch": running}
    if device == "cuda":
        # the paged KV cache takes at most this share of the GPU memory free after the model load,
        # leaving room for the static path's batches (JSON, stop strings, seeded rows)
        config["max_memory_percent"] = 0.8
    else:  # on a CPU transformers would size the cache from the machine's RAM: give it pages instead
        page = 256  # transformers' default page (5.19) / block (5.17) size, in tokens
        per_request = min(max_context or _CPU_TOKENS_PER_REQUEST, _CPU_TOKENS_PER_REQUEST)
        config["num_blocks"] = running * math.ceil(per_request / page) + math.ceil((max_context or page) / page)
        config["max_batch_tokens"] = max(256, running * 8)
    return config


def start(engine, mode, running) -> tuple["ContinuousBatcher | None", dict]:
    """The transformers engine's manager (or None) and its status.json details, after its model
    loaded: ``mode`` (extra_engine_args.continuous_batching) auto means on CUDA; a vision model
    stays static (the manager feeds token ids only)."""
    if mode not in ("auto", True, False):
        raise ValueError(f"extra_engine_args.continuous_batching must be auto, true or false, not {mode!r}")
    if running is not None and (isinstance(running, bool) or not isinstance(running, int) or running < 1):
        raise ValueError(f"extra_engine_args.max_running_requests must be a positive integer, not {running!r}")
    on = engine.device == "cuda" if mode == "auto" else mode
    if on and engine.processor is not None:
        if mode is True:
            raise ValueError(f"{engine.server_args.model_path}: continuous_batching needs a text-only model (this one has a vision tower)")
        on = False
    if not on:
        return None, {"enabled": False, "reason": "off (cpu)" if mode == "auto" else "off (configured)"}
    running = running or (DEFAULT_RUNNING_CUDA if engine.device == "cuda" else engine.batch_size)
    batcher = ContinuousBatcher(
        engine.model, engine.tokenizer, engine.eos_ids, engine.default_params, running, engine.device, engine.max_context
    )
    return batcher, batcher.stats


class ContinuousBatcher:
    """One transformers ContinuousBatchingManager and the requests waiting on it."""

    def __init__(
        self, model, tokenizer, eos_ids: set[int], default_params: dict, running: int, device: str, max_context: int | None,
        stats: dict | None = None,
    ):  # fmt: skip
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self._built_from = (tokenizer, eos_ids, default_params, running, device, max_context)  # rebuilt(): the same
        self.sampler = sampler(default_params)
        self.running = running
        self.eos_ids = sorted(eos_ids)
        self.tokenizer = tokenizer
        gen = {"max_new_tokens": 128, "eos_token_id": self.eos_ids or -1, "pad_token_id": tokenizer.pad_token_id}
        if self.sampler == ("greedy",):
            gen.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            temperature, top_p, top_k = self.sampler
            gen.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
        # the manager's own modules, sharing every weight and buffer with `model` (see the docstring)
        shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        cb_model = copy.deepcopy(model, shared)
        self.manager = cb_model.init_continuous_batching(
            generation_config=GenerationConfig(**gen),
            continuous_batching_config=ContinuousBatchingConfig(**manager_config(running, device, max_context)),
        )
        self.attn_implementation = cb_model.config._attn_implementation
        self.on_cuda = device == "cuda"
        self._pending: dict[str, tuple] = {}  # request id -> (Request, future, loop, prompt tokens, limit, skip)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = threading.Event()
        # status.json's engines.<name>.details.continuous_batching: this dict, counted as requests come
        # (a manager rebuilt after a reload goes on counting in its predecessor's)
        self.stats = stats or {
            "enabled": True, "max_running_requests": running, "attn_implementation": self.attn_implementation,
            "sampler": list(self.sampler), "requests": 0, "static_path_requests": {},
        }  # fmt: skip
        self._started = False
        self._start_lock = threading.Lock()
        self._collector = threading.Thread(target=self._collect, name="transformers-cb-results", daemon=True)
        self._collector.start()

    def served_statically(self, reason: str) -> None:
        """Count a request the engine's static path serves, by why (static_reason)."""
        counts = self.stats["static_path_requests"]
        counts[reason] = counts.get(reason, 0) + 1

    def warmup(self) -> None:
        """Capture the manager's CUDA graphs before the first request (the runner times it as the
        warmup phase), then start its thread. Without it the first request starts the manager."""
        with self._start_lock:
            if not self._started:
                if self.on_cuda:
                    self.manager.warmup()  # before start(), as transformers' generate_batch does
                self.manager.start()
                self._started = True

    def rebuilt(self, model) -> ContinuousBatcher:
        """A new manager on ``model`` (the engine's, reloaded after a device error), counting in
        the same stats, started (warmed up on CUDA) when this one was."""
        batcher = ContinuousBatcher(model, *self._built_from, stats=self.stats)
        if self._started:
            batcher.warmup()
        return batcher

    def fatal_error(self) -> BaseException | None:
        """The exception that ended the manager's thread (transformers records it), if one did."""
        return getattr(getattr(self.manager, "background_thread_status", None), "fatal_error", None)

    def _failed(self, message: str) -> EngineError:
        """The error of a request the manager cannot serve: ``message``, and the exception that
        ended its thread if one did (a device error there is a death: :meth:`cause`)."""
        fatal = self.fatal_error()
        return EngineError(message if fatal is None else f"{message}: {type(fatal).__name__}: {fatal}")

    def cause(self, error: Exception) -> Exception:
        """What killed the manager when ``error`` (a request's failure) says it died of an error
        that leaves the model unusable: the exception its thread recorded (it fails the requests
        first, then records it: wait for the thread to end), else ``error`` itself."""
        if classify_engine_error(error) is None:
            return error
        deadline = time.monotonic() + _DEATH_SECONDS
        while self.manager.is_running() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.fatal_error() or error

    def depth(self) -> int:
        return len(self._pending)

    async def generate(self, request: Request, prompt_ids: list[int], params: dict, limit: int) -> Completion:
        if self._closed.is_set():
            raise EngineStopped("engine was stopped")
        if not self.manager.is_running():
            if self._started:
                raise self._failed("the continuous batching manager is not running (it stopped or failed; see the log)")
            self.warmup()  # the first request: start it (no warmup on CPU)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        rid = f"mirageflow-{next(self._ids)}"
        eos = -1 if params.get("ignore_eos") else (self.eos_ids or -1)
        with self._lock:
            self._pending[rid] = (request, future, loop, len(prompt_ids), limit, params.get("skip_special_tokens", True))
        added = self.manager.add_request(prompt_ids, request_id=rid, max_new_tokens=limit, eos_token_id=eos)
        if added is None:  # the manager refused it: it is stopping (ours: close) or its thread failed
            with self._lock:
                self._pending.pop(rid, None)
            if self._closed.is_set():
                raise EngineStopped("engine was stopped")
            raise self._failed("the continuous batching manager refused the request: it is stopping or failed (see the log)")
        self.stats["requests"] += 1
        return await future

    def _collect(self) -> None:
        """Resolve each finished request's future; fail every waiter when the manager dies."""
        while not self._closed.is_set():
            try:
                out = self.manager.get_result(timeout=_COLLECT_TIMEOUT)
            except Exception as e:  # never leave futures hanging
                self.fail_all(EngineError(f"continuous batching: reading a result failed: {type(e).__name__}: {e}"))
                return
            if out is None:
                if not self.manager.is_running():  # not started yet, or ended: get_result does not wait then
                    if self._pending and not self._closed.is_set():  # its queue is empty: nothing more will come
                        self.fail_all(self._failed("the continuous batching manager stopped with requests pending (see the log)"))
                    time.sleep(_COLLECT_TIMEOUT)
                continue
            if not out.is_finished():
                continue
            with self._lock:
                entry = self._pending.pop(out.request_id, None)
            if entry is None:  # cancelled by stop(), or not ours
                continue
            request, future, loop, n_prompt, limit, skip = entry
            try:
                result = self._completion(out, request, n_prompt, limit, skip)
            except Exception as e:  # decoding failed: this request's caller gets it
                result = EngineError(f"continuous batching: {type(e).__name__}: {e}")
            deliver(future, loop, result)

    def _completion(self, out, request: Request, n_prompt: int, limit: int, skip: bool):
        if out.error is not None or int(out.status) != 3:  # RequestStatus.FINISHED
            return EngineError(f"continuous batching failed request {request.id}: {out.error or f'status {out.status}'}")
        tokens = list(out.generated_tokens)[:limit]
        n = len(tokens)
        # As the static path: a row ends before its limit only through its own EOS.
        finish = "length" if n >= limit else "stop"
        return Completion(request.id, self.tokenizer.decode(tokens, skip_special_tokens=skip), n_prompt, n, finish)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, (_, future, loop, *_rest) in pending.items():
            try:
                self.manager.cancel_request(rid)
            except Exception:  # noqa: S110 - best effort: the manager may be gone; the waiter is failed below
                pass
            deliver(future, loop, error)

    def close(self, error: BaseException | None = None) -> None:
        """Stop the manager; the requests it holds fail with ``error`` (default: EngineStopped)."""
        self.fail_all(error or EngineStopped("engine was stopped"))
        self._closed.set()
        try:
            self.manager.stop(block=True, timeout=30, hard_stop=True)
            self.manager.destroy()
        finally:
            self._collector.join(timeout=5)
