"""SGLang's in-process engine (``backend: sglang``): ``sglang.Engine(**server_args)``.

Each request is one ``engine.async_generate(prompt=..., sampling_params=...)`` call; SGLang
batches whatever is in flight (continuous batching), so the runner's window of
``max_inflight`` requests is all the batching there is. The calls run on a private event
loop (see ``LoopEngine``): SGLang's tokenizer manager binds its receive loop to the first
event loop that generates and would hang on any other.

- Engine arguments: ``server_args`` (model_path, tp_size, dp_size, trust_remote_code,
  disable_custom_all_reduce) plus ``extra_engine_args`` verbatim (they win on a clash).
  ``tp_size: null`` means the job's GPUs (CUDA_VISIBLE_DEVICES) divided by ``dp_size``.
- ``max_inflight``: 2 x ``extra_engine_args.max_running_requests`` when given, else 512.
- JSON outputs: the request's JSON schema (a string) goes to ``sampling_params["json_schema"]``.
- Chat template: the tokenizer the engine loaded (``tokenizer_manager.tokenizer``).
- Tokens and finish reasons come from ``meta_info``; an abort becomes a Completion with
  ``finish_reason="abort"`` (error_kind ``context_length`` or ``aborted``), as does a request
  SGLang rejects with a ValueError (too long for the context, invalid parameters).
- SGLang starts its scheduler with multiprocessing "spawn": the entry script needs an
  ``if __name__ == "__main__":`` guard. ``close()`` always calls ``shutdown()``, which kills
  every child process of this process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping

from mirageflow import stats
from mirageflow.engines.base import Completion, EngineInfo, Request
from mirageflow.engines.http import LoopEngine, is_context_length_error, redact

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT = 512  # without max_running_requests: enough to keep a GPU busy
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def resolve_parallelism(server_args: Mapping, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(tp_size, dp_size): configured values; tp_size null -> the job's GPUs / dp_size (at least 1)."""
    dp = server_args.get("dp_size") or 1
    tp = server_args.get("tp_size")
    if tp is None:
        gpus = stats.allocated_gpus(environ)
        tp = max(1, gpus // dp) if gpus else 1
    return int(tp), int(dp)


def default_max_inflight(server_args: Mapping) -> int:
    running = (server_args.get("extra_engine_args") or {}).get("max_running_requests")
    return 2 * int(running) if running else DEFAULT_MAX_INFLIGHT


def engine_kwargs(server_args: Mapping, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine``: server_args, resolved parallelism, extra args verbatim."""
    args = dict(server_args)
    extra = dict(args.pop("extra_engine_args", None) or {})
    tp, dp = resolve_parallelism(args, environ)
    kwargs = {k: v for k, v in args.items() if v is not None}
    kwargs.update(tp_size=tp, dp_size=dp)
    kwargs.update(extra)
    return kwargs


def sampling_params(request: Request) -> dict:
    params = dict(request.sampling_params)
    if request.json_schema is not None:
        params["json_schema"] = request.json_schema  # SGLang wants the schema as a JSON string
    return params


def completion_from_output(rid: int, out: Mapping) -> Completion:
    """A Completion from SGLang's ``{"text", "meta_info"}`` (offline engine and /generate alike)."""
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    finish = _FINISH.get(kind, "stop") if kind is not None else "stop"
    completion = Completion(
        rid, out.get("text") or "", int(meta.get("prompt_tokens") or 0), int(meta.get("completion_tokens") or 0), finish
    )
    if finish == "abort":
        message = str(reason.get("message") or "") if isinstance(reason, Mapping) else ""
        completion.error_kind = "context_length" if is_context_length_error(message) else "aborted"
        completion.error = "the engine aborted the request" + (f": {message}" if message else "")
    return completion


def rejected(rid: int, message: str) -> Completion:
    """A request the engine refused before running it (no tokens were generated)."""
    kind = "context_length" if is_context_length_error(message) else "invalid_request"
    return Completion(rid, "", 0, 0, "abort", kind, message)


class SGLangEngine(LoopEngine):
    def __init__(self, processor, batch_size: int = 32, log_dir=None):
        super().__init__()
        self.processor = processor
        self.server_args = dict(processor.server_args)
        self.max_inflight = default_max_inflight(self.server_args)
        self.engine = None  # the sglang.Engine
        self.tokenizer = None
        self._shut_down = False
        self.info = EngineInfo(backend="sglang", model_path=self.server_args["model_path"])

    def load(self) -> None:
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(
                'backend sglang needs the sglang package (GPU only): pip install ".[sglang]"; '
                f"or use backend transformers ({e})"
            ) from e
        kwargs = engine_kwargs(self.server_args)
        log.info("starting sglang.Engine(%s)", ", ".join(f"{k}={v!r}" for k, v in redact(kwargs).items()))
        self.engine = sglang.Engine(**kwargs)
        try:
            self.tokenizer = self.engine.tokenizer_manager.tokenizer
            self._start_loop("sglang-engine")
            versions = {"sglang": str(getattr(sglang, "__version__", "unknown"))}
            for name in ("torch", "transformers"):  # already imported by SGLang; never import them here
                module = sys.modules.get(name)
                if module is not None and hasattr(module, "__version__"):
                    versions[name] = str(module.__version__)
            self.info = EngineInfo(
                backend="sglang",
                model_path=self.server_args["model_path"],
                versions=versions,
                device=_device_name(),
                details={
                    "engine_args": redact(kwargs),
                    "max_inflight": self.max_inflight,
                    "gpus_allocated": stats.allocated_gpus(),
                },
            )
        except BaseException:
            self.close()
            raise

    async def _generate(self, request: Request) -> Completion:
        if request.prompt is None:
            raise ValueError("the sglang engine needs a formatted prompt (it templates client-side)")
        try:
            out = await self.engine.async_generate(prompt=request.prompt, sampling_params=sampling_params(request))
        except ValueError as e:  # SGLang's request validation: too long, bad parameters
            return rejected(request.id, str(e))
        if isinstance(out, list):
            out = out[0]
        return completion_from_output(request.id, out)

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
            if self.engine is not None and not self._shut_down:
                self._shut_down = True
                self.engine.shutdown()


def _device_name() -> str:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - informational only
        pass
    return "cuda"
