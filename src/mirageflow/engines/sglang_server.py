"""SGLang as a child HTTP server (``backend: sglang_server``).

The shard job starts ``python -m sglang.launch_server --model-path M --host 127.0.0.1
--port P --tp-size N --dp-size D [server args as flags]`` in its own process group on a
free port, waits for ``GET /health_generate`` to answer 200, then posts each request to the
native ``POST /generate`` (``{"input_ids", "sampling_params"}`` -> ``{"text", "meta_info"}``),
up to ``max_inflight`` at once over keep-alive connections (engines/http_client.py), in the
caller's event loop.

- Prompts: with ``apply_chat_template`` the rendered template goes as token ids with
  exactly one BOS (``base.prompt_token_ids``; SGLang would add a second one to a text
  prompt that starts with it); a raw prompt goes as text (SGLang adds the tokenizer's BOS).
- Image inputs: ``{"text", "image_data"}`` on ``/generate`` (SGLang's native VLM request):
  the client-rendered prompt without its BOS, holding one model placeholder per image
  inside the user turn, and the images as data URIs in placeholder order
  (``sglang_common.image_inputs``), so both SGLang backends send the same prompt.
- JSON outputs: ``sampling_params.json_schema``; after a response prefix, the ``ebnf``
  grammar of its continuation (``sglang_common.sampling_params``), as the sglang backend.
- Row errors: 400 answers (validation, too long, an unknown sampling parameter), and a 500
  whose message is a grammar or length failure (SGLang's HTTPException for a scheduler
  abort, e.g. "Grammar accept_token failed") are not retried: they fail their row, classed
  ``context_length``, ``grammar_error``, ``invalid_request`` or ``aborted``.

- Flags: every ``server_args``/``extra_engine_args`` key ``foo_bar: v`` becomes
  ``--foo-bar v`` (SGLang's flag names are the ServerArgs fields: ``--tp-size``, not ``--tp``) (true -> bare ``--foo-bar``, false/null -> omitted, lists -> several
  values, mappings -> JSON). ``server_command`` replaces the launcher (tests use a stand-in).
- Log: the server's stdout and stderr are appended to ``<log_dir>/sglang_server.log``;
  ``log_dir`` comes from the runner (default: a new temporary directory, kept).
- Start: ``server_start_timeout`` (default 900 s); on timeout or early exit the error names
  the exit code and the log's last 30 lines, and the process tree is killed.
- Chat template: applied client-side with the model's tokenizer (transformers
  AutoTokenizer on the local model path) and ``chat_template_kwargs``.
- Failure: connection errors, timeouts, 429 and 5xx are retried with backoff
  (``max_retries``); if the server process exits, every outstanding and later request
  fails with EngineError naming the exit code and the log tail.
- Shutdown: SIGTERM to the server's process group, SIGKILL after ``kill_grace`` seconds, on
  close(), on a failed load() and at interpreter exit.
- ``extra_engine_args.enable_metrics: true`` starts the server with ``--enable-metrics``; the
  engine scrapes ``/metrics`` after start and before shutdown into
  ``info.details["server_metrics"] = {"start": {...}, "end": {...}}``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from importlib import metadata
from pathlib import Path

from mirageflow.config.types import ProcessorConfig, ServerArgs
from mirageflow.engines.tokens import PromptTokenizer
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.errors import RowErrorClass as E
from mirageflow.engines.http import (
    FATAL_STATUS,
    EngineError,
    error_kind,
    error_message,
    free_port,
    parse_prometheus,
    post_with_retries,
    redact,
    rejected,
)
from mirageflow.engines.http_client import HTTPClient, TransportError
from mirageflow.engines.loop import LoopEngine
from mirageflow.engines.sglang_common import (
    completion_from_output,
    default_max_inflight,
    image_inputs,
    resolve_parallelism,
    sampling_params,
    with_image_tokens,
)
from mirageflow.prompts.images import image_token

log = logging.getLogger(__name__)

METRICS = ["sglang:generation_tokens_total", "sglang:prompt_tokens_total", "sglang:num_running_reqs", "sglang:num_queue_reqs"]
LOG_TAIL_LINES = 30


class ServerDied(EngineError):
    pass


def server_flags(args: dict) -> list[str]:
    """``{"foo_bar": v}`` -> SGLang command-line flags."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def log_tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            tail = deque(f, maxlen=lines)
    except OSError as e:
        return f"(log unreadable: {e})"
    text = b"".join(tail).decode("utf-8", "replace").rstrip()
    return text or "(the log is empty)"


class SGLangServerEngine(LoopEngine):
    health_poll_interval = 0.1  # first wait between health checks; grows x1.5 up to 2 s
    kill_grace = 15.0  # seconds between SIGTERM and SIGKILL
    retry_base_delay = 0.5
    retry_max_delay = 10.0
    host = "127.0.0.1"

    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        super().__init__()
        self.processor = processor
        self.server_args = processor.server_args
        self.extra = dict(self.server_args.extra_engine_args)
        self.max_inflight = default_max_inflight(self.server_args)
        self.log_dir = Path(log_dir) if log_dir else None
        self.enable_metrics = bool(self.extra.get("enable_metrics"))
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.log_path: Path | None = None
        self.command: list[str] = []
        self.tokenizer = None
        self._prompt_ids: PromptTokenizer | None = None
        self._log_offset = 0
        self._client: HTTPClient | None = None  # requests
        self._control: HTTPClient | None = None  # health, versions, metrics (the private loop)
        self._closing = False
        self._killed = False
        self._metrics: dict = {}
        self.image_token = image_token(self.server_args.model_path)  # the placeholder checked per image request
        self.info = EngineInfo(backend="sglang_server", model_path=self.server_args.model_path)

    # ------------------------------------------------------------------ start

    def build_command(self, port: int) -> list[str]:
        launcher = list(self.processor.server_command or [sys.executable, "-m", "sglang.launch_server"])
        args = self.server_args.engine_args()
        args["tp_size"], args["dp_size"] = resolve_parallelism(self.server_args)
        args.update(self.extra)
        model = args.pop("model_path")
        for owned in ("host", "port"):
            if args.pop(owned, None) is not None:
                log.warning("sglang_server: extra_engine_args.%s is ignored; the engine chooses it", owned)
        return [*launcher, "--model-path", str(model), "--host", self.host, "--port", str(port), *server_flags(args)]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def load(self) -> None:
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="mirageflow-sglang-server-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "sglang_server.log"
        self.port = free_port(self.host)
        self.command = self.build_command(self.port)
        with open(self.log_path, "ab") as logf:
            self._log_offset = logf.tell()
            shown = " ".join(redact(self.command))
            logf.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')} mirageflow starts: {shown}\n".encode())
            logf.flush()
            self._log_offset = logf.tell()
            log.info("starting the SGLang server on port %d (log: %s)", self.port, self.log_path)
            started = time.monotonic()
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self._kill_server)
        threading.Thread(target=self._watch, args=(self.process,), name="sglang-server-watch", daemon=True).start()
        try:
            if self.processor.apply_chat_template:
                self.tokenizer = _load_tokenizer(self.server_args)  # while the server boots
                self._prompt_ids = PromptTokenizer(self.tokenizer)
            self._start_loop("sglang-server-client")  # health checks, versions, metrics: not requests
            self._control = HTTPClient(self.base_url, timeout=10.0, trust_env=False)
            self._call(self._wait_healthy())
            # requests run in the caller's loop (LoopEngine._on_caller_loop), at most max_inflight at once
            self._client = HTTPClient(
                self.base_url, max_connections=self.max_inflight, timeout=float(self.processor.request_timeout), trust_env=False
            )
            self.info = EngineInfo(
                backend="sglang_server",
                model_path=self.server_args.model_path,
                versions=self._versions(),
                device="cuda",
                details={
                    "command": redact(self.command),
                    "log": str(self.log_path),
                    "port": self.port,
                    "server_pid": self.process.pid,
                    "server_start_seconds": round(time.monotonic() - started, 3),
                    "max_inflight": self.max_inflight,
                    "prompt_input": "token ids (one BOS)" if self._prompt_ids else "text",
                },
            )
            if self.enable_metrics:
                self._metrics = {"start": self._scrape_metrics(), "end": None}
                self.info.details["server_metrics"] = self._metrics
        except BaseException:
            self.close()
            raise

    async def _wait_healthy(self) -> None:
        timeout = float(self.processor.server_start_timeout)
        deadline = time.monotonic() + timeout
        interval = self.health_poll_interval
        while True:
            rc = self.process.poll()
            if rc is not None:
                raise EngineError(
                    f"the SGLang server exited with code {rc} before it became healthy "
                    f"({' '.join(redact(self.command))}); last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self._tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineError(
                    f"the SGLang server did not become healthy within server_start_timeout={timeout:g} s "
                    f"(GET /health_generate never answered 200); last {LOG_TAIL_LINES} lines of "
                    f"{self.log_path}:\n{self._tail()}"
                )
            try:
                if (await self._control.get("/health_generate", timeout=max(0.2, min(30.0, remaining)))).status_code == 200:
                    return
            except TransportError:
                pass
            await asyncio.sleep(max(0.0, min(interval, deadline - time.monotonic())))
            interval = min(interval * 1.5, 2.0)

    def _get_json(self, path: str):
        return self._call(self._control.get(path)).json()

    def _versions(self) -> dict[str, str]:
        versions = {}
        for path in ("/server_info", "/get_server_info"):  # the second is deprecated in 0.5.23
            try:
                info = self._get_json(path)
            except Exception:  # noqa: BLE001 - informational only
                continue
            if isinstance(info, dict) and info.get("version"):
                versions["sglang"] = str(info["version"])
                break
        if "sglang" not in versions:
            try:
                versions["sglang"] = metadata.version("sglang")
            except metadata.PackageNotFoundError:
                versions["sglang"] = "unknown"
        return versions

    def _scrape_metrics(self) -> dict:
        try:
            r = self._call(self._control.get("/metrics"))
            if r.status_code != 200:
                raise EngineError(f"HTTP {r.status_code} from {self.base_url}/metrics")
        except Exception as e:  # noqa: BLE001 - metrics are informational
            return {"error": f"{type(e).__name__}: {e}"}
        return parse_prometheus(r.text, METRICS)

    # ------------------------------------------------------------------ requests

    async def generate_one(self, request: Request) -> Completion:
        return await self._on_caller_loop(self._generate, request)

    async def _generate(self, request: Request) -> Completion:
        if request.prompt is None:
            raise ValueError("the sglang_server engine needs a formatted prompt (it templates client-side)")
        body: dict = {"sampling_params": sampling_params(request)}
        text_tokens = None
        if request.images:
            found = image_inputs(request, self._prompt_ids, self.image_token)
            if isinstance(found, Completion):
                return found
            body["text"], body["image_data"], text_tokens = found
        elif self._prompt_ids is not None:
            body["input_ids"] = self._prompt_ids(request.prompt)
        else:
            body["text"] = request.prompt
        if self._client is None:
            raise RuntimeError("SGLangServerEngine: load() was not called, or the engine is closed")
        response = await post_with_retries(
            self._client,
            "/generate",
            body,
            max_retries=int(self.processor.max_retries),
            timeout=float(self.processor.request_timeout),
            base_delay=self.retry_base_delay,
            max_delay=self.retry_max_delay,
            what=f"SGLang server {self.base_url}/generate",
            on_transport_error=self._check_alive,
            final=_request_failure,
        )
        if response.status_code != 200:
            message = f"SGLang server answered HTTP {response.status_code}: {error_message(response.content)}"
            if response.status_code in FATAL_STATUS:
                raise EngineError(message)
            return rejected(request.id, message, E.ABORTED if response.status_code >= 500 else E.INVALID_REQUEST)
        out = response.json()  # decoded by post_with_retries
        if isinstance(out, list):
            out = out[0]
        return with_image_tokens(completion_from_output(request.id, out), text_tokens)

    async def _check_alive(self) -> None:
        """After a connection error: fail with the server's exit, if that is what it was."""
        for _ in range(5):  # the socket may close a moment before the exit is seen
            if self._failure is not None or self.process.poll() is not None:
                break
            await asyncio.sleep(0.05)
        if self._failure is not None:
            raise self._failure_error()
        rc = self.process.poll()
        if rc is not None:
            raise self._died(rc)

    def _died(self, rc: int) -> ServerDied:
        return ServerDied(
            f"the SGLang server (pid {self.process.pid}) exited with code {rc} during the run; "
            f"last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self._tail()}"
        )

    def _watch(self, process: subprocess.Popen) -> None:
        rc = process.wait()
        if self._closing:
            return
        error = self._died(rc)
        log.error("%s", error)
        self._fail_all(error)

    def _tail(self) -> str:
        return log_tail(self.log_path, self._log_offset) if self.log_path else "(no log)"

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        self._closing = True
        try:
            if self._metrics and self.process is not None and self.process.poll() is None:
                self._metrics["end"] = self._scrape_metrics()
            self._close_client_and_loop()
        finally:
            self._kill_server()
            atexit.unregister(self._kill_server)

    def _kill_server(self) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after the grace period."""
        process = self.process
        if process is None or self._killed:
            return
        self._killed = True
        self._closing = True
        members = _process_tree(process.pid)  # before the leader goes and its children scatter
        deadline = time.monotonic() + self.kill_grace
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=self.kill_grace)
        except subprocess.TimeoutExpired:
            log.warning("the SGLang server ignored SIGTERM for %g s; killing it", self.kill_grace)
        members = _wait_gone(members, max(0.0, deadline - time.monotonic()))
        try:
            os.killpg(process.pid, signal.SIGKILL)  # also members that outlived the leader
        except ProcessLookupError:
            pass
        _kill(members)  # children that left the group
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("the SGLang server (pid %d) did not exit after SIGKILL", process.pid)
        left = _wait_gone(members, 10)
        if left:
            log.error("processes of the SGLang server survived SIGKILL: %s", [p.pid for p in left])


def _request_failure(response) -> bool:
    """A 5xx that is this request's own failure, not the server's: SGLang answers a scheduler
    abort with its status (a grammar accept failure is a 500) and the message; retrying
    gives the same answer."""
    return response.status_code == 500 and error_kind(error_message(response.content), "") in (E.GRAMMAR_ERROR, E.CONTEXT_LENGTH)


def _load_tokenizer(server_args: ServerArgs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_args.model_path, trust_remote_code=server_args.trust_remote_code)


def _process_tree(pid: int) -> list:
    """The server's descendants and its process group's members (psutil; [] without it)."""
    try:
        import psutil
    except ImportError:
        return []
    found = {}
    try:
        for child in psutil.Process(pid).children(recursive=True):
            found[child.pid] = child
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        try:
            if p.pid != pid and p.pid not in found and os.getpgid(p.pid) == pid:
                found[p.pid] = p
        except (OSError, psutil.Error):
            pass
    return list(found.values())


def _running(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(processes: list, timeout: float) -> list:
    """Those of ``processes`` still running after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        processes = [p for p in processes if _running(p)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.02)


def _kill(processes: list) -> None:
    for p in processes:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
