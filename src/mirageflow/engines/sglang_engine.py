"""SGLang's in-process engine (``backend: sglang``): ``sglang.Engine(**server_args)``.

Each request is one ``engine.async_generate(input_ids=..., sampling_params=...)`` call;
SGLang batches whatever is in flight (continuous batching), so the runner's window of
``max_inflight`` requests is all the batching there is. The calls run on a private event
loop (see ``LoopEngine``): SGLang's tokenizer manager binds its receive loop to the first
event loop that generates and would hang on any other.

- Engine arguments: ``server_args`` (model_path, tp_size, dp_size, trust_remote_code,
  disable_custom_all_reduce) plus ``extra_engine_args`` verbatim (they win on a clash).
  ``tp_size: null`` means the job's GPUs (CUDA_VISIBLE_DEVICES) divided by ``dp_size``.
- ``max_inflight``: 2 x ``extra_engine_args.max_running_requests`` when given, else 512.
- Prompts go as token ids, with exactly one BOS (``base.prompt_token_ids``): SGLang
  tokenizes a text prompt with ``add_special_tokens=True``, which would put a second BOS
  before a chat template that starts with one.
- Image inputs: the prompt goes as text (without its BOS) with one model placeholder per
  image, inside the user turn, and ``image_data`` as data URIs in the same order
  (``sglang_common.image_inputs``); a prompt whose placeholder count differs from its
  images fails its row (``image_placeholders``).
- JSON outputs: the request's JSON schema (a string) goes to ``sampling_params["json_schema"]``;
  with a response prefix (the prompt ends with it) the grammar of its continuation goes to
  ``sampling_params["ebnf"]`` instead (``sglang_common.sampling_params``, engines/json_prefix.py).
- Chat template: the tokenizer the engine loaded (``tokenizer_manager.tokenizer``).
- Row errors (Completions with ``error_kind``, never a shard halt): aborts in ``meta_info``,
  ValueErrors (validation, too long) and the HTTPException SGLang raises for other aborts
  (a grammar failure is a 500): ``context_length``, ``grammar_error``, ``invalid_request``
  or ``aborted`` by message (``sglang_common.request_error``).
- Crashes: a failing SGLang subprocess (scheduler exception, KV-cache or CUDA-graph OOM, a
  watchdog timeout; SGLang's subprocess watchdog for one that died without a word) sends
  SIGQUIT to this process, and SGLang's own handler then kills the whole process tree, this
  shard included, leaving no failure record. The engine installs its own handler instead
  (``ServerArgs.custom_sigquit_handler``, from the main thread).
- Reloads (issue 36): such a crash, or a device error raised from a request
  (server_process.classify_engine_error), is a death of the engine, classified from what is
  visible (server_process.classify_crash: the exit code SGLang's watchdog logged, the
  out-of-memory or device-error lines in the tail of this process's stderr, the job log where
  SGLang's children write their tracebacks) and kept (engines/reloads.py). A reload thread shuts
  the dead engine down (its watchdog stops, every child process of this process is killed),
  waits the supervisor's backoff and builds a new ``sglang.Engine`` with the same arguments
  (off the main thread SGLang leaves our SIGQUIT handler installed), up to
  ``processors[].max_restarts`` times; the requests the dead engine held are sent again to
  its successor (only those: an answered request is never sent again; counted in the death's
  ``requests_resent``), and requests that come meanwhile wait for it. Once the reloads are
  spent the next death fails every outstanding and later request, and ``load()``, with
  SGLangCrashed naming every death, its class failure.json's ``failure_class``, and the tail
  of the job log. A crash during the first load is a load error (not reloaded).
- SGLang starts its scheduler with multiprocessing "spawn": the entry script needs an
  ``if __name__ == "__main__":`` guard. ``close()`` always calls ``shutdown()``, which kills
  every child process of this process.
"""

from __future__ import annotations


import asyncio
import logging
import signal
import sys
import threading
import time
from concurrent.futures import Future

from mirageflow.config.types import ProcessorConfig
from mirageflow.stats import formulas as stats
from mirageflow.engines.base import EngineDied, EngineError, EngineStopped
from mirageflow.engines.http import redact, stderr_tail
from mirageflow.engines.loop import LoopEngine, cancel_all
from mirageflow.engines.registry import SGLANG_INSTALL
from mirageflow.engines.reloads import InProcessReloads
from mirageflow.engines.server_process import classify_crash, classify_engine_error
from mirageflow.engines.server_restarts import wait_future
from mirageflow.engines.tokens import PromptTokenizer
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.engines.sglang_common import (
    completion_from_output,
    default_max_inflight,
    engine_kwargs,
    image_inputs,
    request_error,
    sampling_params,
    with_image_tokens,
)
from mirageflow.errors import EngineDeathClass as D
from mirageflow.prompts.images import image_token

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 30
SIGQUIT_CAUSE = "an SGLang subprocess failed and signalled SIGQUIT"
RELOAD_JOIN_SECONDS = 300.0  # close() waits this long for a reload under way (a new sglang.Engine starting)


class SGLangCrashed(EngineDied):
    """The SGLang engine died (a subprocess signalled SIGQUIT, or a device error) and is not
    reloaded: ``death_class`` is the last death's."""


class SGLangEngine(LoopEngine):
    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        super().__init__()
        self.processor = processor
        self.server_args = processor.server_args
        self.max_inflight = default_max_inflight(self.server_args)
        self.engine = None  # the sglang.Engine serving now (the dead one while a reload is under way)
        self.tokenizer = None
        self._prompt_ids: PromptTokenizer | None = None
        self._shut_down = False  # self.engine was shut down
        self._crash: str | None = None  # SIGQUIT arrived while the first sglang.Engine started
        self._previous_sigquit = None
        self.image_token = image_token(self.server_args.model_path)  # the placeholder checked per image request
        self.info = EngineInfo(backend="sglang", model_path=self.server_args.model_path)
        # reloads (module docstring): the engine's generation, its death, its successor
        self.reloads = InProcessReloads("the SGLang engine", processor.max_restarts)
        self._sglang = None  # the module, and the sglang.Engine arguments, for a reload
        self._kwargs: dict = {}
        self.generation = 0  # engines that served before this one
        self._dying = False  # the serving engine died; its successor is not serving yet
        self._successor: Future = Future()  # done when the successor serves (or never will)
        self._death_of: dict[int, dict] = {}  # generation -> the death that ended it
        self._died_at: dict[int, float] = {}  # generation -> when it died (monotonic)
        self._sending: set[asyncio.Task] = set()  # requests awaiting the engine now (engine loop only)
        self._start_crashed = False  # SIGQUIT while a successor started
        self._serving = False  # load() returned: a crash from now on is a death (before: a load error)
        self._closing = False
        self._wake = threading.Event()  # set by stop/close: a reload's backoff ends
        self._lock = threading.Lock()
        self._reload_thread: threading.Thread | None = None

    def load(self) -> None:
        try:
            import sglang
        except ImportError as e:
            raise EngineError(
                f"backend sglang needs the sglang package (GPU only): {SGLANG_INSTALL}; or use backend transformers ({e})"
            ) from e
        kwargs = engine_kwargs(self.server_args)
        shown = redact(kwargs)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigquit = signal.getsignal(signal.SIGQUIT)
            kwargs["custom_sigquit_handler"] = self._on_sigquit
            handler = "mirageflow (a crash reloads the engine, up to max_restarts, then fails the shard with its cause)"
        else:  # SGLang then installs none either: a crash leaves requests hanging until stop()
            handler = "none (load() was not called from the main thread)"
            log.warning("sglang: load() outside the main thread; a crash of SGLang's scheduler will not be noticed")
        self._sglang, self._kwargs = sglang, kwargs
        log.info("starting sglang.Engine(%s)", ", ".join(f"{k}={v!r}" for k, v in shown.items()))
        children = _children()
        started = time.monotonic()
        try:
            self.engine = sglang.Engine(**kwargs)
        except BaseException as e:
            _kill_new_children(children)  # what SGLang's own SIGQUIT handler would have killed
            self._restore_sigquit()
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            raise EngineError(self._failure_message(f"SGLang failed to start: {type(e).__name__}: {e}")) from e
        try:
            self._use_tokenizer()
            self._start_loop("sglang-engine")
            versions = {"sglang": str(getattr(sglang, "__version__", "unknown"))}
            for name in ("torch", "transformers"):  # already imported by SGLang; never import them here
                module = sys.modules.get(name)
                if module is not None and hasattr(module, "__version__"):
                    versions[name] = str(module.__version__)
            self.info = EngineInfo(
                backend="sglang",
                model_path=self.server_args.model_path,
                versions=versions,
                device=_device_name(),
                details={
                    "engine_args": shown,
                    "max_inflight": self.max_inflight,
                    "max_restarts": self.reloads.max_restarts,
                    "gpus_allocated": stats.allocated_gpus(),
                    "sigquit_handler": handler,
                    "prompt_input": "token ids (one BOS)" if self._prompt_ids else "text",
                    "start_seconds": round(time.monotonic() - started, 3),
                },
            )
            if self._crash:  # SIGQUIT arrived while SGLang finished starting
                raise SGLangCrashed(self._failure_message("the SGLang engine crashed while it started"))
            self._serving = True
        except BaseException:
            self.close()
            raise

    def _use_tokenizer(self) -> None:
        """The tokenizer of the engine serving now (``self.engine``)."""
        self.tokenizer = self.engine.tokenizer_manager.tokenizer
        self._prompt_ids = PromptTokenizer(self.tokenizer) if self.tokenizer is not None else None

    # ------------------------------------------------------------------ deaths and reloads

    def _failure_message(self, what: str) -> str:
        """``what``, a crash while the first engine started, and the job log's tail."""
        if self._crash and self._crash not in what:
            what += f"; {self._crash}"
        tail = stderr_tail(LOG_TAIL_LINES)
        return what + (f"\nlast {LOG_TAIL_LINES} lines of this job's log (SGLang writes there):\n{tail}" if tail else "")

    def _on_sigquit(self, signum=None, frame=None) -> None:
        """SGLang's ``custom_sigquit_handler``: runs in the main thread when a child failed."""
        if not self._serving:  # still starting: load() reports it (with the constructor's error)
            if not self._crash:
                self._crash = SIGQUIT_CAUSE
                log.error("sglang: %s while starting", SIGQUIT_CAUSE)
            return
        if self._dying:  # the dead engine's second word, or its successor failed while starting
            self._start_crashed = True
            return
        death_class, cause = classify_crash(stderr_tail(LOG_TAIL_LINES))
        self._died(death_class, f"{SIGQUIT_CAUSE}: {cause}")

    def _died(self, death_class: D, cause: str) -> None:
        """The serving engine died (any thread): its requests wait for a successor, reloaded in a
        thread of its own, or fail when the reloads are spent."""
        with self._lock:
            if self._dying or self._failure is not None or self._closing:
                return
            self._dying = True
            generation = self.generation
        self._death_of[generation] = self.reloads.died(death_class, cause)
        self._died_at[generation] = time.monotonic()
        if self._loop is not None:  # the requests it holds never answer: sent again to the successor
            try:
                self._loop.call_soon_threadsafe(cancel_all, self._sending)
            except RuntimeError:  # the loop is closed
                pass
        if self.reloads.spent:
            self._give_up()
            return
        self._reload_thread = threading.Thread(target=self._reload, name="sglang-reload", daemon=True)
        self._reload_thread.start()

    def _reload(self) -> None:
        """The reload thread: shut the dead engine down, then start successors until one serves
        or the reloads are spent."""
        t0, death = self._died_at[self.generation], self._death_of[self.generation]
        self._shutdown_engine()
        while True:
            if self.reloads.spent or self._closing or self._wake.wait(self.reloads.delay()):
                self._give_up()
                return
            self.reloads.count += 1
            log.warning("reloading the SGLang engine (reload %d of at most %d)", self.reloads.count, self.reloads.max_restarts)
            children, started = _children(), time.monotonic()
            self._start_crashed = False
            engine = None
            try:
                engine = self._sglang.Engine(**self._kwargs)
                if self._start_crashed:
                    raise SGLangCrashed(f"{SIGQUIT_CAUSE} while it started")
            except Exception as e:  # noqa: BLE001 - a reload that failed is a death of its own
                if engine is not None:  # it started, then a subprocess signalled: its watchdog stops first
                    _shutdown_quietly(engine)
                _kill_new_children(children)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.reloads.died(D.FAILED_TO_START, f"{type(e).__name__}: {first}"[:300])
                continue
            with self._lock:
                closing = self._closing
                if not closing:
                    self.engine, self._shut_down = engine, False
                    self._use_tokenizer()
                    successor, self._successor = self._successor, Future()
                    self.generation += 1
                    self._dying = False
            if closing:
                engine.shutdown()
                self._give_up()
                return
            death["restarted_after_seconds"] = round(time.monotonic() - t0, 3)
            death["successor_start_seconds"] = round(time.monotonic() - started, 3)
            log.warning("the SGLang engine serves again after %.1f s", time.monotonic() - t0)
            successor.set_result(None)
            return

    def _give_up(self) -> None:
        """No more reloads: every waiting, outstanding and later request fails."""
        if self._closing:
            final = EngineStopped("the SGLang engine was not reloaded: the engine is stopping")
        else:
            why = f"processors[].max_restarts={self.reloads.max_restarts}" + (" spent" if self.reloads.max_restarts else ": not reloaded")
            final = self.reloads.give_up(why, SGLangCrashed, self._failure_message(""))
            log.error("%s", final)
        self._fail_all(final)
        if not self._successor.done():
            self._successor.set_exception(final)

    def _shutdown_engine(self) -> None:
        """Shut ``self.engine`` down once (SGLang stops its watchdog and kills every child process)."""
        if self.engine is None or self._shut_down:
            return
        self._shut_down = True
        # its tokenizer manager's tasks in the engine loop (handle_loop, sigterm_watchdog) wait for
        # nothing now, and one that raised would kill the whole process (print_exception_wrapper)
        background = set(getattr(getattr(self.engine, "tokenizer_manager", None), "asyncio_tasks", None) or ())
        if background and self._loop is not None and not self._closing:
            try:
                self._loop.call_soon_threadsafe(cancel_all, background)
            except RuntimeError:  # the loop is closed
                pass
        _shutdown_quietly(self.engine)

    def _restore_sigquit(self) -> None:
        if self._previous_sigquit is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGQUIT) == self._on_sigquit:
                    signal.signal(signal.SIGQUIT, self._previous_sigquit)
            except (ValueError, TypeError):
                pass
            self._previous_sigquit = None

    def restarts(self) -> int:
        return self.reloads.count

    def deaths(self) -> list[dict]:
        return self.reloads.listing()

    # ------------------------------------------------------------------ requests

    async def _generate(self, request: Request) -> Completion:
        if request.prompt is None:
            raise ValueError("the sglang engine needs a formatted prompt (it templates client-side)")
        params = sampling_params(request)
        task = asyncio.current_task()
        while True:
            if self._dying:  # a reload is under way: wait for it (raises the final error when none follows)
                await wait_future(self._successor)
                continue
            generation = self.generation
            self._sending.add(task)
            try:
                completion = await _ask(self.engine, self._prompt_ids, self.image_token, request, params)
                before = self._death_of.get(generation - 1)  # the successor's first answer, timed from that death
                if before is not None and before["first_answer_after_seconds"] is None:
                    before["first_answer_after_seconds"] = round(time.monotonic() - self._died_at[generation - 1], 3)
                return completion
            except asyncio.CancelledError:
                if self._failure is not None or not (self._dying or generation != self.generation):
                    raise
                task.uncancel()  # cancelled by the engine's death (_died), not by the caller
            except Exception as e:  # noqa: BLE001 - a row error, a death, or re-raised
                if self._failure is not None:
                    raise self._failure_error() from None
                found = classify_engine_error(e)  # a device error leaves the engine unusable
                if found is None:
                    completion = request_error(request.id, e)
                    if completion is None:
                        raise
                    return completion
                self._died(*found)
            finally:
                self._sending.discard(task)
            if generation == self.generation:
                await wait_future(self._successor)
            death = self._death_of.get(generation)
            if death is not None:
                death["requests_resent"] += 1

    def stop(self) -> None:
        self._closing = True  # no reload from now on; one under way gives up
        self._wake.set()
        super().stop()  # fail every outstanding request now (those waiting for a successor too)
        manager = getattr(self.engine, "tokenizer_manager", None)
        if manager is not None and self._loop is not None:

            def abort_all():  # and free the GPU from them (best effort; the API varies by version)
                try:
                    manager.abort_request(abort_all=True)
                except Exception:  # noqa: BLE001
                    log.debug("abort_request(abort_all=True) failed", exc_info=True)

            try:
                self._loop.call_soon_threadsafe(abort_all)
            except RuntimeError:  # the loop is closed
                pass

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        thread = self._reload_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(RELOAD_JOIN_SECONDS)  # it shuts down a successor that started meanwhile
        try:
            self._stop_loop()
        finally:
            try:
                self._shutdown_engine()
            finally:
                self._restore_sigquit()


async def _ask(engine, prompt_ids: PromptTokenizer | None, placeholder: str, request: Request, params: dict) -> Completion:
    """One request to ``engine`` (the sglang.Engine serving now)."""
    text_tokens = None
    if request.images:
        found = image_inputs(request, prompt_ids, placeholder)
        if isinstance(found, Completion):
            return found
        text, image_data, text_tokens = found
        out = await engine.async_generate(prompt=text, image_data=image_data, sampling_params=params)
    elif prompt_ids is not None:
        out = await engine.async_generate(input_ids=prompt_ids(request.prompt), sampling_params=params)
    else:  # skip_tokenizer_init: SGLang has no tokenizer; neither has this engine
        out = await engine.async_generate(prompt=request.prompt, sampling_params=params)
    if isinstance(out, list):
        out = out[0]
    return with_image_tokens(completion_from_output(request.id, out), text_tokens)


def _shutdown_quietly(engine) -> None:
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - a dead engine's shutdown may fail; its children are killed anyway
        log.warning("shutting an SGLang engine down failed", exc_info=True)


def _children() -> set[int]:
    try:
        import psutil

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001 - psutil missing: nothing to compare
        return set()


def _kill_new_children(before: set[int]) -> None:
    """Kill the processes SGLang started during a failed start (its scheduler, detokenizer)."""
    try:
        import psutil

        for p in psutil.Process().children(recursive=True):
            if p.pid not in before:
                try:
                    p.kill()
                except psutil.Error:
                    pass
    except Exception:  # noqa: BLE001 - best effort
        log.debug("could not kill SGLang's children", exc_info=True)


def _device_name() -> str:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - informational only
        pass
    return "cuda"
