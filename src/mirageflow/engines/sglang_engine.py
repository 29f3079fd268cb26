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
  watchdog timeout) sends SIGQUIT to this process, and SGLang's own handler then kills the
  whole process tree, this shard included, leaving no failure record. The engine installs
  its own handler instead (``ServerArgs.custom_sigquit_handler``, from the main thread):
  every outstanding and later request, or ``load()``, fails at once with an EngineError
  naming the cause and the tail of this process's stderr (the job log, where SGLang's
  children write their tracebacks).
- SGLang starts its scheduler with multiprocessing "spawn": the entry script needs an
  ``if __name__ == "__main__":`` guard. ``close()`` always calls ``shutdown()``, which kills
  every child process of this process.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from mirageflow.config.types import ProcessorConfig
from mirageflow.stats import formulas as stats
from mirageflow.engines.base import EngineError
from mirageflow.engines.http import redact, stderr_tail
from mirageflow.engines.loop import LoopEngine
from mirageflow.engines.registry import SGLANG_INSTALL
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
from mirageflow.prompts.images import image_token

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 30


class SGLangCrashed(EngineError):
    """An SGLang subprocess failed (it signalled SIGQUIT): the engine is gone."""


class SGLangEngine(LoopEngine):
    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        super().__init__()
        self.processor = processor
        self.server_args = processor.server_args
        self.max_inflight = default_max_inflight(self.server_args)
        self.engine = None  # the sglang.Engine
        self.tokenizer = None
        self._prompt_ids: PromptTokenizer | None = None
        self._shut_down = False
        self._crash: str | None = None  # why SGLang signalled SIGQUIT, once it did
        self._previous_sigquit = None
        self.image_token = image_token(self.server_args.model_path)  # the placeholder checked per image request
        self.info = EngineInfo(backend="sglang", model_path=self.server_args.model_path)

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
            handler = "mirageflow (a crash fails the shard with its cause)"
        else:  # SGLang then installs none either: a crash leaves requests hanging until stop()
            handler = "none (load() was not called from the main thread)"
            log.warning("sglang: load() outside the main thread; a crash of SGLang's scheduler will not be noticed")
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
            manager = self.engine.tokenizer_manager
            self.tokenizer = manager.tokenizer
            if self.tokenizer is not None:
                self._prompt_ids = PromptTokenizer(self.tokenizer)
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
                    "gpus_allocated": stats.allocated_gpus(),
                    "sigquit_handler": handler,
                    "prompt_input": "token ids (one BOS)" if self._prompt_ids else "text",
                    "start_seconds": round(time.monotonic() - started, 3),
                },
            )
            if self._crash:  # SIGQUIT arrived while SGLang finished starting
                raise SGLangCrashed(self._crash)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ crashes

    def _failure_message(self, what: str) -> str:
        message = what
        if self._crash:
            message += f"; {self._crash}"
        tail = stderr_tail(LOG_TAIL_LINES)
        if tail:
            message += f"\nlast {LOG_TAIL_LINES} lines of this job's log (SGLang writes there):\n{tail}"
        return message

    def _on_sigquit(self, signum=None, frame=None) -> None:
        """SGLang's ``custom_sigquit_handler``: runs in the main thread when a child failed."""
        if self._crash:
            return
        self._crash = "an SGLang subprocess failed and signalled SIGQUIT (scheduler exception, out of memory, watchdog timeout)"
        if self.engine is None:  # still starting: load() reports it with the constructor's error
            log.error("sglang: %s while starting", self._crash)
            return
        error = SGLangCrashed(self._failure_message("the SGLang engine crashed"))
        log.error("%s", error)
        self._fail_all(error)

    def _restore_sigquit(self) -> None:
        if self._previous_sigquit is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGQUIT) == self._on_sigquit:
                    signal.signal(signal.SIGQUIT, self._previous_sigquit)
            except (ValueError, TypeError):
                pass
            self._previous_sigquit = None

    # ------------------------------------------------------------------ requests

    async def _generate(self, request: Request) -> Completion:
        if request.prompt is None:
            raise ValueError("the sglang engine needs a formatted prompt (it templates client-side)")
        params = sampling_params(request)
        text_tokens = None
        try:
            if request.images:
                found = image_inputs(request, self._prompt_ids, self.image_token)
                if isinstance(found, Completion):
                    return found
                text, image_data, text_tokens = found
                out = await self.engine.async_generate(prompt=text, image_data=image_data, sampling_params=params)
            elif self._prompt_ids is not None:
                out = await self.engine.async_generate(input_ids=self._prompt_ids(request.prompt), sampling_params=params)
            else:  # skip_tokenizer_init: SGLang has no tokenizer; neither has this engine
                out = await self.engine.async_generate(prompt=request.prompt, sampling_params=params)
        except Exception as e:  # noqa: BLE001 - a row error, or re-raised
            if self._failure is not None:
                raise self._failure_error() from None
            completion = request_error(request.id, e)
            if completion is None:
                raise
            return completion
        if isinstance(out, list):
            out = out[0]
        return with_image_tokens(completion_from_output(request.id, out), text_tokens)

    def stop(self) -> None:
        super().stop()  # fail every outstanding request now
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
        try:
            self._stop_loop()
        finally:
            try:
                if self.engine is not None and not self._shut_down:
                    self._shut_down = True
                    self.engine.shutdown()
            finally:
                self._restore_sigquit()


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
