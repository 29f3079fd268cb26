"""SGLang as a child HTTP server (``backend: sglang_server``).

The shard job starts ``python -m sglang.launch_server --model-path M --host 127.0.0.1
--port P --tp-size N --dp-size D [server args as flags]`` in its own process group on a
free port, waits for ``GET /health_generate`` to answer 200, then posts each request to the
native ``POST /generate`` (``{"input_ids", "sampling_params"}`` -> ``{"text", "meta_info"}``),
up to ``max_inflight`` at once over keep-alive connections (transport/http_client.py), in the
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
  (``max_retries``); a server that exits or freezes is restarted on a new port and the
  requests it held are sent again (engines/server_restarts.py: ``max_restarts``,
  ``hang_seconds``, its hang probe ``GET /health``); once the restarts are spent, every
  outstanding and later request fails with ``ServerDied`` naming each death and the log tail.
- Shutdown: SIGTERM to the server's process group, SIGKILL after ``kill_grace`` seconds, on
  close(), on a failed load() and at interpreter exit.
- ``extra_engine_args.enable_metrics: true`` starts the server with ``--enable-metrics``; the
  engine scrapes ``/metrics`` after start, during the run and before shutdown
  (engines/server_metrics.py) into ``info.details["server_metrics"]``: tokens, requests,
  radix-cache hit rate, retractions and queue length as the server counted them.
- Process: engines/server_process.py (start, health wait, log tail, SIGTERM then SIGKILL),
  restarted by engines/server_restarts.py.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from mirageflow.config.types import LaunchedServer, ProcessorConfig, ServerArgs
from mirageflow.engines.tokens import PromptTokenizer
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.errors import RowErrorClass as E
from mirageflow.engines.http import (
    FATAL_STATUS,
    EngineError,
    error_kind,
    error_message,
    post_with_retries,
    redact,
    rejected,
)
from mirageflow.transport.http_client import HTTPClient
from mirageflow.engines.loop import LoopEngine
from mirageflow.engines.server_metrics import SGLANG, ServerMetrics
from mirageflow.engines.server_process import LOG_TAIL_LINES, ServerProcess, log_tail, server_flags  # noqa: F401 - re-exported
from mirageflow.engines.server_ranks import NodeSpan, RankFlags, span_details
from mirageflow.engines.server_restarts import ServerDied, ServerSupervisor, Supervised  # noqa: F401 - ServerDied: re-exported
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

# execution_params.nodes > 1: SGLang's own multi-node flags (tp_size spans the nodes; ranks > 0 serve no HTTP)
RANKS = RankFlags(lambda nnodes, host, port: ["--nnodes", str(nnodes), "--dist-init-addr", f"{host}:{port}"])
METRICS = SGLANG.all  # what is scraped (tests/real_sglang_checks.py checks the names against the package)


class SGLangServerEngine(Supervised, LoopEngine):
    spans_nodes = True  # execution_params.nodes > 1: --nnodes/--node-rank/--dist-init-addr (engines/server_ranks.py)
    health_poll_interval = 0.1  # first wait between health checks; grows x1.5 up to 2 s
    kill_grace = 15.0  # seconds between SIGTERM and SIGKILL
    retry_base_delay = 0.5
    retry_max_delay = 10.0
    host = "127.0.0.1"

    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        super().__init__()
        self.processor = processor
        self.server_args = processor.server_args
        # its group is None only in a processor built without the loader (a test): the schema's defaults then
        self.launch = processor.launch or LaunchedServer()
        self.extra = dict(self.server_args.extra_engine_args)
        self.max_inflight = default_max_inflight(self.server_args)
        self.log_dir = Path(log_dir) if log_dir else None
        self.enable_metrics = bool(self.extra.get("enable_metrics"))
        self.supervisor: ServerSupervisor | None = None  # the server's starts and restarts
        self.log_path: Path | None = None
        self._old_clients: list[HTTPClient] = []  # clients of servers that died
        self.tokenizer = None
        self._prompt_ids: PromptTokenizer | None = None
        self._client: HTTPClient | None = None  # requests
        self._control: HTTPClient | None = None  # versions (the private loop)
        self._metrics: ServerMetrics | None = None
        self.image_token = image_token(self.server_args.model_path)  # the placeholder checked per image request
        self.info = EngineInfo(backend="sglang_server", model_path=self.server_args.model_path)

    # ------------------------------------------------------------------ start

    def build_command(self, port: int) -> list[str]:
        launcher = list(self.launch.command or [sys.executable, "-m", "sglang.launch_server"])
        args = self.server_args.engine_args()
        args["tp_size"], args["dp_size"] = resolve_parallelism(self.server_args)
        args.update(self.extra)
        model = args.pop("model_path")
        for owned in ("host", "port"):
            if args.pop(owned, None) is not None:
                log.warning("sglang_server: extra_engine_args.%s is ignored; the engine chooses it", owned)
        return [*launcher, "--model-path", str(model), "--host", self.host, "--port", str(port), *server_flags(args)]

    def load(self) -> None:
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="mirageflow-sglang-server-"))
        self.log_path = log_dir / "sglang_server.log"
        env = {str(k): str(v) for k, v in (self.launch.env or {}).items()}
        self.supervisor = supervisor = ServerSupervisor(
            "the SGLang server", self.build_command, self.log_path, env, host=self.host, ready_path="/health_generate",
            probe_path="/health", start_timeout=float(self.launch.start_timeout),
            poll_interval=self.health_poll_interval, kill_grace=self.kill_grace,
            max_restarts=self.processor.max_restarts, hang_seconds=self.processor.hang_seconds,
            span=NodeSpan.from_slurm(self.processor.nodes) if self.processor.nodes > 1 else None, rank_flags=RANKS,
        )  # fmt: skip
        supervisor.on_death, supervisor.on_restarted, supervisor.on_final = self._on_death, self._on_restarted, self._fail_all
        try:
            supervisor.start_process()
            log.info("starting the SGLang server on port %d (log: %s)", self.port, self.log_path)
            if self.processor.apply_chat_template:
                self.tokenizer = _load_tokenizer(self.server_args)  # while the server boots
                self._prompt_ids = PromptTokenizer(self.tokenizer)
            started = supervisor.wait_started()
            self._start_loop("sglang-server-client")  # versions: not requests
            self._control = HTTPClient(self.base_url, timeout=10.0, trust_env=False)
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
                    "server_pid": self.server.pid,
                    "server_start_seconds": round(started, 3),
                    "max_inflight": self.max_inflight,
                    "prompt_input": "token ids (one BOS)" if self._prompt_ids else "text",
                    "max_restarts": self.processor.max_restarts,
                    "hang_seconds": self.processor.hang_seconds,
                    **span_details(self.server),
                },
            )
            if self.enable_metrics:
                self._metrics = ServerMetrics(f"{self.base_url}/metrics", "sglang")
                self._metrics.begin()
            supervisor.watch()
        except BaseException:
            self.close()
            raise

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

    # ------------------------------------------------------------------ requests

    async def generate_one(self, request: Request) -> Completion:
        if self.supervisor is None:
            raise RuntimeError("SGLangServerEngine: load() was not called, or the engine is closed")
        return await self.supervisor.call(lambda: self._on_caller_loop(self._generate, request))

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
        client, server = self._client, self.server  # this request's server, also if it dies meanwhile
        if client is None:
            raise RuntimeError("SGLangServerEngine: load() was not called, or the engine is closed")
        response = await post_with_retries(
            client,
            "/generate",
            body,
            max_retries=int(self.processor.max_retries),
            timeout=float(self.processor.request_timeout),
            base_delay=self.retry_base_delay,
            max_delay=self.retry_max_delay,
            what=f"SGLang server {self.base_url}/generate",
            on_transport_error=lambda: self.supervisor.check_alive(server),
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

    def _on_death(self) -> None:
        if self._metrics is not None:  # the counters of a dead server are gone: its figures stop here
            self._metrics.end(alive=False)

    def _on_restarted(self, server: ServerProcess, base_url: str) -> None:
        """A successor serves at ``base_url``: later requests go there (the old client is closed with the engine)."""
        old = self._client
        self._client = HTTPClient(
            base_url, max_connections=self.max_inflight, timeout=float(self.processor.request_timeout), trust_env=False
        )  # fmt: skip
        if old is not None:
            self._old_clients.append(old)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        super().stop()

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        supervisor = self.supervisor
        if supervisor is not None:
            supervisor.stop()  # its exit from now on is no death
        try:
            if self._metrics is not None:
                server = self.server
                self._metrics.end(alive=server is not None and server.poll() is None)
                self.info.details["server_metrics"] = self._metrics.summary()
            for client in self._old_clients:
                client.close()
            self._old_clients = []
            self._close_client_and_loop()
        finally:
            if supervisor is not None:
                supervisor.kill()


def _request_failure(response) -> bool:
    """A 5xx that is this request's own failure, not the server's: SGLang answers a scheduler
    abort with its status (a grammar accept failure is a 500) and the message; retrying
    gives the same answer."""
    return response.status_code == 500 and error_kind(error_message(response.content), "") in (E.GRAMMAR_ERROR, E.CONTEXT_LENGTH)


def _load_tokenizer(server_args: ServerArgs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_args.model_path, trust_remote_code=server_args.trust_remote_code)
