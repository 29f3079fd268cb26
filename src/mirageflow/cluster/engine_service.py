"""One engine serving several shard jobs: the ``engine`` rule's job (``shards_per_engine`` > 1).

With ``execution_params.shards_per_engine: K``, shard ``i`` is served by engine group
``i // K``. The rule ``engine`` (workflow/rules/engines.smk) is a Snakemake *service*: its
output ``<state_dir>/engines/engine_<g>.json`` is the endpoint file, written at once (the
jobs module writes it before any import: Snakemake starts the consumers right away and
gives the file only ``--latency-wait`` seconds to appear). Then this module loads every
processor the shards would load (``create_engine``, the GPU claim and the time limit as for
a shard), warms them up and serves them on 127.0.0.1 until Snakemake terminates it
(SIGTERM) once its shards are done. The shards talk to it through engines/shared.py.

The protocol is a small JSON one over HTTP/1.1 (stdlib asyncio streams: a few dozen lines,
no server dependency; the requests are ours, on loopback; JSON by orjson, as the client's,
transport/http_client.py):

- ``GET /health``: 200 ``{"state": "ready"}`` after load and warm-up; 503 while loading;
  500 with ``error`` when loading failed.
- ``GET /info``: per processor its ``EngineInfo``, ``max_inflight`` and the chat template
  (``ChatTemplate.spec``, so shards render prompts without loading a tokenizer).
- ``POST /generate`` ``{"processor", "request"}`` -> ``{"completion"}``: the fields of
  engines.wire.Request / Completion, so token ids, BOS handling, JSON grammar and
  reasoning stay the in-process engine's. An engine exception -> 500 ``{"error"}``.
- ``POST /chat_prompt`` ``{"processor", "messages", "kwargs"}`` -> ``{"prompt"}`` (when
  the template has no portable fast path); 422 ``{"error"}`` when the template refuses.

This module is the engine job's serving process: the job itself (cluster/service_restarts.py)
launches it and replaces it when it dies or freezes (silent for ``hang_seconds``), up to
``max_restarts`` times; the deaths so far are in the endpoint file (``deaths``), carried by each
successor. ``/health`` is answered by the event loop, while the engines generate in threads of
their own (transformers' batcher, in-process engines' private loops) or wait on their launched
servers' HTTP answers, so a busy service still answers the job's hang probe and the shards'
heartbeat. It stops as on SIGTERM (writing its stats) when its engine job is gone (checked every
``PARENT_POLL_SECONDS``): a job killed with SIGKILL leaves no orphan serving until its idle exit.

Its own measurements go to ``<state_dir>/engines/engine_<g>.stats.json``: one entry per
load (``loads``, appended by each start), with load/warm-up seconds, device, engine info,
requests served, the restarts and deaths of its launched servers and the service death it
``replaced`` (None for the first), so the report counts each load once. A launched server (``vllm_server``, ``sglang_server``) that dies or freezes
is restarted inside the service (engines/server_restarts.py): the requests it held are sent
again, the shards' requests wait meanwhile (their heartbeat still answered), within the
restarts' bound (``max_restarts`` x (backoff + ``server_start_timeout``)), and fail only once
the restarts are spent. A service nobody talks to for
``$MIRAGEFLOW_ENGINE_IDLE_EXIT`` seconds (600; shards send a heartbeat every 5 s: engines/shared.py HEARTBEAT_SECONDS) exits:
Snakemake does not stop a service whose consumers could not start.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import time
import traceback
from pathlib import Path

from mirageflow.config.types import PipelineConfig, ProcessorConfig
from mirageflow.stats import formulas as stats
from mirageflow.files import atomic_write_json
from mirageflow.engines import registry
from mirageflow.engines.base import Engine, death_class_of
from mirageflow.engines.registry import create_engine
from mirageflow.engines.wire import Request
from mirageflow.transport.http_client import dumps, loads
from mirageflow.state.layout import StateLayout
from mirageflow.cluster.engine_groups import served_processors

log = logging.getLogger(__name__)

IDLE_EXIT_SECONDS = 600.0
PARENT_POLL_SECONDS = 1.0  # how often the serving process looks for its engine job
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    422: "Unprocessable Entity",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def stats_path(state_dir: str | Path, group: int) -> Path:
    return StateLayout(state_dir).engine_stats(group)


def _served(status: dict) -> bool:
    return any((e.get("details") or {}).get("shared_engine") for e in (status.get("engines") or {}).values())


def shared_engine_summary(state_dir: str | Path, statuses: list[dict]) -> dict | None:
    """The report's view of the engine services: each load counted once (the stats files'
    ``loads``), and the shards' own load phase, which for a served shard is only its wait
    for the service. None when no engine service ran."""
    loads = []
    for path in StateLayout(state_dir).engine_stats_files():
        try:
            loads += [entry for entry in json.loads(path.read_text()).get("loads") or [] if entry]
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (its loads are not counted): %s", path, e)
    if not loads:
        return None
    served = [s for s in statuses if _served(s)]
    own = sum(s["stats"].get("model_load_seconds") or 0 for s in statuses if not _served(s))
    engine_load = sum(entry.get("model_load_seconds") or 0 for entry in loads)
    return {
        "engine_groups": len({entry["group"] for entry in loads}),
        "engine_loads": len(loads),
        "failed_loads": sum(1 for entry in loads if entry.get("state") == "failed"),
        "engine_model_load_seconds": engine_load,
        "engine_warmup_seconds": sum(entry.get("warmup_seconds") or 0 for entry in loads),
        "engine_requests": sum(entry.get("requests") or 0 for entry in loads),
        "engine_restarts": sum(entry.get("engine_restarts") or 0 for entry in loads),
        # loads that replaced a dead service (cluster/service_restarts.py): once each, not once per shard
        "service_replacements": sum(1 for entry in loads if entry.get("replaced")),
        "shards_served": len(served),
        "served_shards_wait_seconds": sum(s["stats"].get("model_load_seconds") or 0 for s in served),
        # what sum_model_load_seconds reports: engine loads once + shards that loaded their own
        "sum_model_load_seconds_attributed": engine_load + own,
    }


def shared_engine_factory(cfg: PipelineConfig, endpoint: str | Path):
    """The shard runner's engine factory for a shard served by the engine service of
    ``endpoint``: engines/shared.py for the served processors, ``create_engine`` for the
    others (openai)."""
    served = set(served_processors(cfg))

    def factory(processor: ProcessorConfig, batch_size: int, log_dir=None) -> Engine:
        if processor.type not in served:
            return create_engine(processor, batch_size, log_dir=log_dir)
        return registry.engine_class(registry.SHARED)(processor, batch_size, log_dir=log_dir, endpoint=endpoint)

    return factory


class EngineService:
    def __init__(self, cfg: PipelineConfig, group: int, endpoint: Path, log_path: str | None = None):
        self.cfg, self.group, self.endpoint = cfg, group, Path(endpoint)
        self.stats_file = stats_path(cfg.state_dir, group)
        self.log_path = log_path
        self.engines: dict[str, Engine] = {}
        self.templates: dict[str, object] = {}
        self.state, self.error = "loading", None
        self.requests = self.input_tokens = self.output_tokens = self.errors = 0
        self.load_seconds = self.warmup_seconds = 0.0
        self.started_at = stats.utc_now()
        self.last_activity = time.monotonic()
        self.idle_exit = float(os.environ.get("MIRAGEFLOW_ENGINE_IDLE_EXIT", IDLE_EXIT_SECONDS))
        self._entry: int | None = None  # this load's place in the stats file's list
        # the service's deaths in this job before this process (the engine job writes them in the
        # endpoint file when one dies: cluster/service_restarts.py); each successor carries them
        self.deaths = _deaths_in(self.endpoint)
        self._done: asyncio.Event | None = None

    # ------------------------------------------------------------------ files

    def _write_endpoint(self, port: int) -> None:
        atomic_write_json(self.endpoint, {
            "group": self.group, "state": self.state, "error": self.error, "host": "127.0.0.1", "port": port,
            "hostname": socket.gethostname(), "pid": os.getpid(), "log": self.log_path,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started_at": self.started_at, "deaths": self.deaths,
        })  # fmt: skip
        self.port = port

    def _load_entry(self, finished: bool = False) -> dict:
        return {
            "group": self.group, "hostname": socket.gethostname(), "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started_at": self.started_at,
            "finished_at": stats.utc_now() if finished else None, "state": self.state, "error": self.error,
            "model_load_seconds": self.load_seconds, "warmup_seconds": self.warmup_seconds,
            "num_gpus": stats.allocated_gpus(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "engines": {name: _jsonable(vars(e.info)) for name, e in self.engines.items()},
            "requests": self.requests, "request_errors": self.errors,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            # its launched servers restarted while serving (engines/server_restarts.py); its shards waited meanwhile
            "engine_restarts": sum(e.restarts() for e in self.engines.values()),
            "engine_deaths": [{"processor": name, **d} for name, e in self.engines.items() for d in e.deaths()],
            # this load replaced a service that died (cluster/service_restarts.py): that death
            "replaced": self.deaths[-1] if self.deaths else None,
        }  # fmt: skip

    def write_stats(self, finished: bool = False) -> None:
        """Append (first call) or update this load's entry in the stats file."""
        try:
            data = json.loads(self.stats_file.read_text())
        except FileNotFoundError:
            data = {"group": self.group, "loads": []}
        except ValueError as e:  # kept aside, not lost: the report then misses its earlier loads
            aside = self.stats_file.with_suffix(".damaged.json")
            log.error("%s is not JSON (%s): moved to %s, starting a new one", self.stats_file, e, aside)
            os.replace(self.stats_file, aside)
            data = {"group": self.group, "loads": []}
        loads = data.setdefault("loads", [])
        if self._entry is None:
            self._entry = len(loads)
            loads.append(None)
        loads[self._entry] = self._load_entry(finished)
        atomic_write_json(self.stats_file, data)

    # ------------------------------------------------------------------ engines

    def load(self) -> None:
        t0 = time.monotonic()
        for name in served_processors(self.cfg):
            log_dir = StateLayout(self.cfg.state_dir).engine_server_logs(self.group)
            engine = create_engine(self.cfg.processors[name], self.cfg.batch_size, log_dir=log_dir)
            if self.cfg.shard.max_inflight:
                engine.max_inflight = self.cfg.shard.max_inflight
            engine.commit_seconds = self.cfg.shard.checkpoint_seconds  # its shards commit this often
            self.engines[name] = engine
            engine.load()
        gc.collect()
        self.load_seconds = time.monotonic() - t0
        t0 = time.monotonic()
        for engine in self.engines.values():
            engine.warmup()  # a no-op unless the engine warms_up
        self.warmup_seconds = time.monotonic() - t0
        for name, engine in self.engines.items():
            self.templates[name] = _template_spec(engine)

    def close(self) -> None:
        for engine in self.engines.values():
            try:
                engine.close()
            except Exception:  # closing must not hide why the service ends
                log.exception("closing engine failed")

    # ------------------------------------------------------------------ HTTP

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if path == "/health":
            code = {"ready": 200, "loading": 503}.get(self.state, 500)
            return code, {"state": self.state, "error": self.error, "group": self.group}
        if self.state != "ready":
            return 503, {"state": self.state, "error": self.error}
        if path == "/info" and method == "GET":
            k, n = self.cfg.execution.shards_per_engine, self.cfg.num_shards
            return 200, {
                "group": self.group, "stats_file": str(self.stats_file),
                # the GPUs this service holds and the shards sharing them (the last group may
                # be smaller): each shard counts num_gpus / shards of them (engines/shared.py)
                "num_gpus": stats.allocated_gpus(), "shards": len(range(self.group * k, min((self.group + 1) * k, n))),
                "model_load_seconds": self.load_seconds, "warmup_seconds": self.warmup_seconds,
                "engines": {
                    name: {"info": _jsonable(vars(e.info)), "max_inflight": e.max_inflight, "chat_template": self.templates[name],
                           # the served engine's server applies the chat template (vllm_server): shards send messages
                           "templates_server_side": e.templates_server_side}
                    for name, e in self.engines.items()
                },
            }  # fmt: skip
        if method != "POST" or path not in ("/generate", "/chat_prompt"):
            return 404, {"error": f"no {method} {path}"}
        try:
            msg = loads(body)
            engine = self.engines[msg["processor"]]
        except (ValueError, KeyError, TypeError) as e:
            return 400, {"error": f"bad request body: {type(e).__name__}: {e}"}
        if path == "/chat_prompt":
            try:
                return 200, {"prompt": engine.chat_prompt(msg["messages"], msg.get("kwargs") or {})}
            except Exception as e:  # a template refusing these messages: the row's error
                return 422, {"error": f"{type(e).__name__}: {e}"}
        request = Request(**msg["request"])
        if request.images:  # sent as JSON by engines/shared.py: the bytes in base64
            from mirageflow.prompts.images import CanonicalImage

            request.images = [CanonicalImage(**{**i, "data": base64.b64decode(i["data"])}) for i in request.images]
        try:
            completion = await engine.generate_one(request)
        except Exception as e:  # the engine broke: the shard fails with this (engines/shared.py)
            self.errors += 1
            log.error("processor %s failed on request %s: %s", msg["processor"], request.id, traceback.format_exc())
            # the class of its launched server's last death when the restarts are spent: the shards' failure_class
            return 500, {"error": f"{type(e).__name__}: {e}", "failure_class": death_class_of(e)}
        self.requests += 1
        self.input_tokens += completion.prompt_tokens
        self.output_tokens += completion.completion_tokens
        return 200, {"completion": dataclasses.asdict(completion)}

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 with keep-alive and Content-Length bodies: what transport/http_client.py sends."""
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                self.last_activity = time.monotonic()
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = h.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                try:
                    code, payload = await self._route(method, path, body)
                except Exception as e:  # a request this service cannot take (e.g. a client of another version)
                    log.error("%s %s failed: %s", method, path, traceback.format_exc())
                    code, payload = 500, {"error": f"{type(e).__name__}: {e}"}
                data = dumps(payload)
                head = f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                writer.write(head.encode() + data)
                await writer.drain()
                self.last_activity = time.monotonic()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return  # the client went away (its shard ended or was killed)
        finally:
            writer.close()

    async def _watchdog(self) -> None:
        """Exit when idle too long; refresh the stats file every minute (a killed service keeps its counts)."""
        written = time.monotonic()
        while True:
            await asyncio.sleep(min(5.0, self.idle_exit / 4))
            if self.state == "ready" and time.monotonic() - written > 60:
                self.write_stats()
                written = time.monotonic()
            if time.monotonic() - self.last_activity > self.idle_exit:
                log.error("no shard talked to this engine for %.0f s: exiting", self.idle_exit)
                self._done.set()
                return

    async def _parent_watch(self, parent: int) -> None:
        """Stop as on SIGTERM once ``parent``, the engine job that launched this process, is gone:
        killed outright (SIGKILL), it could not stop this process, which runs in a session of its
        own. Its orphan is adopted by another process, so ``getppid`` changes. (Not
        PR_SET_PDEATHSIG: it fires when the launching *thread* ends, and the job launches
        successors from short-lived restart threads.)"""
        while os.getppid() == parent:
            await asyncio.sleep(PARENT_POLL_SECONDS)
        log.error("the engine job (process %d) that launched this serving process is gone: stopping", parent)
        self._done.set()

    async def serve(self, server: asyncio.base_events.Server, parent: int | None = None) -> None:
        """Load (in a thread, so /health answers meanwhile), then serve until stopped: SIGTERM,
        idle for ``idle_exit``, or ``parent`` (the engine job's pid) gone."""
        self._done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._done.set)
        watchdog = asyncio.create_task(self._watchdog())
        orphan_watch = asyncio.create_task(self._parent_watch(parent)) if parent is not None else None
        try:
            await loop.run_in_executor(None, self.load)
        except Exception as e:
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("loading the engine failed:\n%s", traceback.format_exc())
            self._write_endpoint(self.port)
            self.write_stats(finished=True)
            await asyncio.sleep(2)  # shards polling /health read the error rather than a refused connection
            raise
        self.state = "ready"
        self._write_endpoint(self.port)
        self.write_stats()
        log.info(
            "engine group %d ready on port %d: load %.1f s, warm-up %.1f s", self.group, self.port, self.load_seconds, self.warmup_seconds
        )
        try:
            await self._done.wait()
        finally:
            watchdog.cancel()
            if orphan_watch is not None:
                orphan_watch.cancel()
            server.close()
            self.state = "stopped"
            self.write_stats(finished=True)
            log.info("engine group %d stopped: %d requests served", self.group, self.requests)


def _template_spec(engine: Engine) -> dict | None:
    """The chat template as ``ChatTemplate.spec`` gives it, when the engine templates with
    the default (tokenizer) path; None -> shards ask /chat_prompt."""
    from mirageflow.engines.chat_template import ChatTemplate

    if type(engine).chat_prompt is not Engine.chat_prompt or engine.tokenizer is None:
        return None
    return ChatTemplate(engine.tokenizer).spec()


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def _deaths_in(endpoint: Path) -> list[dict]:
    try:
        return list(json.loads(endpoint.read_text()).get("deaths") or [])
    except (OSError, ValueError, AttributeError):  # none yet (a first start), or not ours
        return []


def run(cfg: PipelineConfig, group: int, endpoint: str, log_path: str | None = None, port: int = 0, parent: int | None = None) -> None:
    """The engine job's serving process: serve group ``group`` on ``port`` (0: any) until
    SIGTERM or until the engine job ``parent`` is gone; raises when loading failed. ``parent``:
    the job's pid, as the job passed it (cluster/service_restarts.py), so a job killed before
    this process got here is seen gone too; None: this process's parent now."""
    if parent is None:
        parent = os.getppid()
    service = EngineService(cfg, group, Path(endpoint), log_path)

    async def main() -> None:
        server = await asyncio.start_server(service._connection, "127.0.0.1", port, limit=2**24)
        service._write_endpoint(server.sockets[0].getsockname()[1])
        async with server:
            await service.serve(server, parent)

    try:
        asyncio.run(main())
    finally:
        service.close()
