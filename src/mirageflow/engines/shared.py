"""A shard's client of an engine served by the ``engine`` rule (``shards_per_engine`` > 1).

The engine service (mirageflow/cluster/engine_service.py) loads the model once for the K shards of
its group; each shard uses this engine instead of loading its own. ``load`` only waits:
for the endpoint file to name a port, then for ``/health`` to say ready (the service
loads and warms up meanwhile). It then reads ``/info``: the served engine's EngineInfo
(kept in status.json with ``details.shared_engine`` naming the endpoint and stats
files, so the report counts the load once per engine, not per shard), its
``max_inflight`` and its chat template, rendered here with the same compiled-template
fast path (``ChatTemplate.from_spec``) so no shard loads a tokenizer; a template without
that path is rendered by the service (``/chat_prompt``).

``generate_one`` posts the Request's fields and rebuilds the Completion, so token ids,
BOS handling, JSON grammar and reasoning are the served engine's own. It runs in the
caller's event loop over keep-alive connections (transport/http_client.py, JSON by orjson);
the engine's private loop does the rest (waiting for the service, the heartbeat, prompts
the service renders). A service that failed to load fails the shard with an EngineError
naming the endpoint file and the service's log. A service that dies or stops answering
(a connection error, or the heartbeat: ``GET /health`` every ``HEARTBEAT_SECONDS``, each
with a deadline of ``HEARTBEAT_TIMEOUT``, so a SIGSTOPped service is noticed within 65 s)
is waited for: a successor (the engine job replaces a dead serving process, and kills and
replaces a frozen one, silent for ``hang_seconds``: cluster/service_restarts.py; it says
``restarting`` at once) must name itself (a live process) in the endpoint file within
``$MIRAGEFLOW_ENGINE_RESTART_WAIT`` seconds (``RESTART_WAIT_SECONDS``) and be ready within
``$MIRAGEFLOW_ENGINE_WAIT``; the requests the dead one held are then sent to it again, and
later requests wait for it. A service found alive but silent must first be gone from the
endpoint file within this processor's ``processors[].hang_seconds`` plus the job's probe
interval and deadline plus ``$MIRAGEFLOW_ENGINE_RESTART_WAIT`` (server_restarts
``frozen_killed_within``); with ``hang_seconds: null`` nothing watches it and the shard fails
at once (or, had it closed the connection, once it still runs ``DYING_GRACE_SECONDS`` later:
a process on its way out closes its sockets before its pid is gone). Each death so lived
through is this engine's (``restarts``, ``deaths``: status.json's ``engine_restarts`` and
``engine_deaths``), its class the engine job's (the endpoint's ``deaths``: ``frozen`` for a
frozen one). When none comes, or the endpoint says ``died`` (the
job's replacements are spent), every outstanding and later request fails (EngineDied, class
``engine_service_died``), never a hang. A generation itself has no deadline: it may wait its
turn behind the other shards' requests. The heartbeat also keeps the service's idle watchdog quiet.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import os
import socket
from pathlib import Path

from mirageflow.config.types import ProcessorConfig
from mirageflow.engines.base import EngineDied, EngineError
from mirageflow.engines.server_restarts import frozen_killed_within, new_death, wait_future
from mirageflow.errors import EngineDeathClass as D
from mirageflow.engines.chat_template import ChatTemplate
from mirageflow.engines.loop import LoopEngine
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.transport.http_client import DeadlineExceeded, HTTPClient, TransportError

log = logging.getLogger(__name__)

WAIT_SECONDS = 3600.0  # for the service to load (a large model on a slow filesystem); $MIRAGEFLOW_ENGINE_WAIT
# for a restarted service to name itself in the endpoint file after its predecessor died; $MIRAGEFLOW_ENGINE_RESTART_WAIT
RESTART_WAIT_SECONDS = 60.0
DEAD_GRACE_SECONDS = 5.0  # a process gone this long (not a stale file about to be replaced) will not answer
DYING_GRACE_SECONDS = 10.0  # a process that closed its connections and still runs: exiting (or frozen, if it stays)
HEARTBEAT_SECONDS = 5.0
HEARTBEAT_TIMEOUT = 60.0  # a /health answer later than this: the service is frozen
CONTROL_TIMEOUT = 60.0  # /info, /chat_prompt (a template render)


class _RemoteTemplate:
    """The ``apply_chat_template`` the template's slow path calls: the service renders."""

    def __init__(self, engine: "SharedEngine"):
        self.engine = engine

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        return self.engine._call(self.engine._chat_prompt(messages, kwargs), timeout=60)


class SharedEngine(LoopEngine):
    """Requests to the engine service of this shard's group; ``endpoint`` is its endpoint file."""

    loads_model = False  # the engine service loaded it (gpu_share: this shard's part of its GPUs, set at load)

    def __init__(self, processor: ProcessorConfig, batch_size: int, log_dir=None, endpoint: str | Path | None = None):
        super().__init__()
        if endpoint is None:
            raise ValueError("the shared engine needs the endpoint file of its engine service")
        self.processor, self.name, self.endpoint = processor, processor.type, Path(endpoint)
        self.max_inflight = 2 * batch_size  # until /info gives the served engine's
        self.wait_seconds = float(os.environ.get("MIRAGEFLOW_ENGINE_WAIT", WAIT_SECONDS))
        self.restart_wait_seconds = float(os.environ.get("MIRAGEFLOW_ENGINE_RESTART_WAIT", RESTART_WAIT_SECONDS))
        self.generation = 0  # services connected to before the one serving now
        self._successor = None  # a concurrent Future: done when the lost service's successor serves (or never will)
        self._old_clients: list[HTTPClient] = []  # the clients of services that died (closed with the engine)
        self._deaths: list[dict] = []  # the services this shard lived through: engine_deaths (status.json)
        self._death_of: dict[int, dict] = {}  # generation -> the death that ended its service
        self._lost_at: dict[int, float] = {}  # generation -> when this shard found its service gone (monotonic)
        self._url: str | None = None  # the service's that _client and _control talk to
        self.info = EngineInfo(backend="shared", model_path=processor.server_args.model_path)
        self._client: HTTPClient | None = None  # requests, in the caller's loop
        self._control: HTTPClient | None = None  # the rest, in the private loop
        self._heartbeat: asyncio.Task | None = None
        self._service: dict = {}

    # ------------------------------------------------------------------ setup

    def _where(self) -> str:
        log = self._service.get("log")
        return f"engine service {self.endpoint}" + (f" (its log: {log})" if log else "")

    def _read_endpoint(self) -> dict | None:
        try:
            return json.loads(self.endpoint.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # being replaced (atomic, but an NFS client may see it half-way)
            return None

    def load(self) -> None:
        self._start_loop("shared-engine")
        try:
            self._call(self._connect())
        except BaseException:
            self._close_client_and_loop()
            raise

    async def _connect(self, lost: str | None = None) -> None:
        """Wait for the service to be ready, then read what it serves. ``lost``: why the
        service connected to before was lost (a restart's wait: its successor must name itself
        within ``restart_wait_seconds``, else EngineDied engine_service_died)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_seconds
        dead_grace = DEAD_GRACE_SECONDS if lost is None else self.restart_wait_seconds
        pause, dead_since = 0.02, None
        while True:
            ep = self._read_endpoint()
            if ep is None and lost is not None:  # the engine job ended and its output was removed: nothing comes
                dead_since = dead_since if dead_since is not None else loop.time()
                if loop.time() - dead_since > dead_grace:
                    raise EngineDied(
                        f"the {self._where()} died ({lost}) and its endpoint file is gone: no service follows",
                        str(D.ENGINE_SERVICE_DIED),
                    )
            if ep is not None:
                self._service = ep
                if ep.get("state") == "failed":
                    raise EngineError(f"the {self._where()} failed to load: {ep.get('error')}")
                if ep.get("state") == "died":  # the engine job's replacements are spent (cluster/service_restarts.py)
                    raise EngineDied(f"the {self._where()} died and is not replaced: {ep.get('error')}", str(D.ENGINE_SERVICE_DIED))
                # a process gone that long (not a stale file about to be replaced) will not answer
                if ep.get("hostname") == socket.gethostname() and not _alive(ep.get("pid")):
                    dead_since = dead_since if dead_since is not None else loop.time()
                    if loop.time() - dead_since > dead_grace:
                        if lost is not None:
                            raise EngineDied(
                                f"the {self._where()} died ({lost}) and no restarted service named itself in the endpoint "
                                f"file within {dead_grace:g} s ($MIRAGEFLOW_ENGINE_RESTART_WAIT)",
                                str(D.ENGINE_SERVICE_DIED),
                            )
                        raise EngineError(f"the {self._where()} exited before it was ready (process {ep['pid']} is gone)")
                else:
                    dead_since = None
                if ep.get("hostname") not in (None, socket.gethostname()):
                    raise EngineError(
                        f"the {self._where()} runs on {ep['hostname']}, this shard on {socket.gethostname()}: "
                        "a shard and its engine must share a node (one group job)"
                    )
                url = f"http://{ep['host']}:{ep['port']}" if ep.get("port") else None
                if url is not None and url != self._url and dead_since is None:  # a (new) live service names its port
                    self._old_clients += [c for c in (self._client, self._control) if c is not None]
                    self._url = url
                    self._control = HTTPClient(url, timeout=CONTROL_TIMEOUT, trust_env=False)
                    self._client = HTTPClient(url, timeout=None, trust_env=False)  # a generation waits its turn
                if self._control is not None:
                    try:
                        r = await self._control.get("/health", timeout=HEARTBEAT_TIMEOUT)
                    except TransportError:
                        pass  # not listening yet, or gone (above)
                    else:
                        if r.status_code == 200:
                            break
                        if r.status_code != 503:
                            raise EngineError(f"the {self._where()} failed to load: {self._error_of(r)}")
            if loop.time() > deadline:
                message = f"the {self._where()} was not ready after {self.wait_seconds:.0f} s (state: {(ep or {}).get('state', 'no endpoint file')})"
                if lost is not None:
                    raise EngineDied(f"{message}; its predecessor died ({lost})", str(D.ENGINE_SERVICE_DIED))
                raise EngineError(message)
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 1.0)
        served = await self._json(await self._control.get("/info"))
        engine = served["engines"].get(self.name)
        if engine is None:
            raise EngineError(f"the {self._where()} does not serve processor '{self.name}' (it serves {sorted(served['engines'])})")
        details = dict(engine["info"].get("details") or {})
        details["shared_engine"] = {
            "endpoint": str(self.endpoint), "group": served["group"], "stats_file": served["stats_file"],
            "hostname": self._service.get("hostname"), "pid": self._service.get("pid"),
        }  # fmt: skip
        self.info = EngineInfo(**{**engine["info"], "details": details})
        self.max_inflight = engine["max_inflight"]
        # a served engine whose server applies the chat template (vllm_server): the runner
        # sends the messages, no prompt is rendered here
        self.templates_server_side = bool(engine.get("templates_server_side"))
        # this shard's share of the service's GPUs: K shards run at once on them, so each
        # counts 1/K and the report's GPU-hours count the engine's GPUs once, not K times
        self.gpu_share = served.get("num_gpus", 0) / max(served.get("shards", 1), 1)
        if engine["chat_template"] is not None:
            self._chat_template = ChatTemplate.from_spec(engine["chat_template"], _RemoteTemplate(self))
        else:
            self._chat_template = _RemoteTemplateOnly(_RemoteTemplate(self))
        self._heartbeat = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        generation = self.generation
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            try:
                r = await self._control.get("/health", timeout=HEARTBEAT_TIMEOUT)
                ok, silent = r.status_code == 200, False
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except TransportError as e:
                ok, why, silent = False, f"{type(e).__name__}: {e}", isinstance(e, DeadlineExceeded)
            if not ok:
                self._lose(generation, why, silent)
                return

    def _lose(self, generation: int, why: str, silent: bool = False):
        """The service of ``generation`` is lost (``silent``: it stopped answering, else it
        answered an error or closed the connection): wait for its successor (one wait for
        every caller, in the private loop). The Future of that wait; it raises when none comes."""
        from concurrent.futures import Future

        if generation != self.generation or self._failure is not None:  # its successor serves already, or none will
            done: Future = Future()
            if self._failure is not None:
                done.set_exception(self._failure)
            else:
                done.set_result(None)
            return done
        if self._successor is None:
            self._successor = asyncio.run_coroutine_threadsafe(self._reconnect(generation, why, silent), self._loop)
        return self._successor

    async def _reconnect(self, generation: int, why: str, silent: bool) -> None:
        log.warning("the %s is lost (%s); waiting for a restarted service", self._where(), why)
        if self._heartbeat is not None and self._heartbeat is not asyncio.current_task():
            self._heartbeat.cancel()
        ep = self._read_endpoint() or self._service
        lost_pid = self._service.get("pid")
        self._lost_at[generation] = asyncio.get_running_loop().time()
        try:
            if ep.get("hostname") == socket.gethostname() and _alive(ep.get("pid")) and ep.get("pid") == lost_pid:
                # alive and silent (SIGSTOPped, stuck): frozen, not dead; the engine job kills it after hang_seconds
                await _wait_frozen_replaced(self, lost_pid, why, silent)
            self._old_clients += [c for c in (self._client, self._control) if c is not None]
            self._client = self._control = self._url = None
            await self._connect(lost=why)
        except BaseException as e:
            self._fail_all(e)
            raise
        finally:
            self._successor = None
        self._record_death(generation, why, lost_pid)
        self.generation = generation + 1
        log.warning("the %s serves again (process %s)", self._where(), self._service.get("pid"))

    def _record_death(self, generation: int, why: str, pid) -> None:
        """The death of the service of ``generation``, now replaced: the engine job's record of it
        (its class from the exit status: the endpoint's ``deaths``), else this shard's."""
        carried = self._service.get("deaths") or []
        if carried and carried[-1].get("at") not in {d.get("at") for d in self._deaths}:
            death = dict(carried[-1])
        else:  # replaced by something other than the engine job (a person, a wrapper)
            death = new_death(D.ENGINE_SERVICE_DIED, f"the engine service stopped answering: {why}", pid)
        death["requests_resent"] = 0
        death["restarted_after_seconds"] = round(asyncio.get_running_loop().time() - self._lost_at[generation], 3)
        self._deaths.append(death)
        self._death_of[generation] = death

    def restarts(self) -> int:
        """The replacements of the engine service this shard lived through."""
        return len(self._deaths)

    def deaths(self) -> list[dict]:
        return [dict(d) for d in self._deaths]

    # ------------------------------------------------------------------ requests

    async def _chat_prompt(self, messages, kwargs) -> str:
        r = await self._post("/chat_prompt", control=True, body={"processor": self.name, "messages": messages, "kwargs": kwargs})
        if r.status_code == 422:
            raise ValueError(self._error_of(r))  # the template refused the messages: the row's error
        self._check(r)
        return (await self._json(r))["prompt"]

    async def _post(self, path: str, body: dict, control: bool = False):
        """``POST path`` to the service; sent again to its successor when it died meanwhile."""
        while True:
            generation, client = self.generation, self._control if control else self._client
            if client is None:  # a restart is under way
                await wait_future(self._lose(generation, "restarting"))
                continue
            try:
                answer = await client.post_json(path, body)
            except TransportError as e:
                await wait_future(self._lose(generation, f"{type(e).__name__}: {e}", isinstance(e, DeadlineExceeded)))
                death = self._death_of.get(generation)
                if death is not None:  # it was in flight when its service died: sent again, once per death
                    death["requests_resent"] += 1
                continue
            death = self._death_of.get(generation - 1)
            if death is not None and death.get("first_answer_after_seconds") is None:
                death["first_answer_after_seconds"] = round(asyncio.get_running_loop().time() - self._lost_at[generation - 1], 3)
            return answer

    @staticmethod
    def _error_of(r) -> str:
        try:
            return str(r.json().get("error"))
        except (ValueError, AttributeError):
            return r.text[:500]

    async def _json(self, r) -> dict:
        """The service's answer as a JSON object, or an EngineError that says what came instead."""
        try:
            data = r.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise EngineError(f"the {self._where()} answered HTTP {r.status_code} with a body that is not a JSON object: {r.text[:200]!r}")
        return data

    def _check(self, r) -> None:
        if r.status_code != 200:
            message = f"the {self._where()} failed (HTTP {r.status_code}): {self._error_of(r)}"
            try:
                death_class = r.json().get("failure_class")
            except (ValueError, AttributeError):
                death_class = None
            # the served engine died for good (its launched server's restarts spent): the shard's failure_class
            raise EngineDied(message, death_class) if death_class else EngineError(message)

    async def generate_one(self, request: Request) -> Completion:
        return await self._on_caller_loop(self._generate, request)

    async def _generate(self, request: Request) -> Completion:
        if self._loop is None:
            raise RuntimeError("SharedEngine: load() was not called, or the engine is closed")
        r = await self._post("/generate", {"processor": self.name, "request": _request_json(request)})
        self._check(r)
        return Completion(**(await self._json(r))["completion"])

    def close(self) -> None:
        if self._heartbeat is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._heartbeat.cancel)
        for client in self._old_clients:
            client.close()
        self._old_clients = []
        self._close_client_and_loop()


class _RemoteTemplateOnly:
    """A template without the portable fast path: every prompt is rendered by the service."""

    def __init__(self, remote: _RemoteTemplate):
        self.remote = remote

    def __call__(self, messages, kwargs=None) -> str:
        return self.remote.apply_chat_template(messages, **(kwargs or {}))


async def _wait_frozen_replaced(engine: SharedEngine, pid, why: str, silent: bool) -> None:
    """``engine``'s wait (in its private loop) until the serving process ``pid``, alive though it
    did not answer, is gone or no longer named in the endpoint file (the engine job killed it and
    says ``restarting``): within this processor's ``hang_seconds``
    (the job's watchdog uses the smallest of its processors', so no later than this one's) plus
    the watchdog's probe interval and deadline, plus ``restart_wait_seconds`` for the job's
    kill and endpoint write. EngineDied engine_service_died when it stays. With ``hang_seconds``
    null nobody watches the service: a ``silent`` one fails at once, one that closed the
    connection or answered an error is given ``DYING_GRACE_SECONDS`` to exit (then the job
    replaces it as any dead one)."""
    hang = engine.processor.hang_seconds
    unwatched = "processors[].hang_seconds is null: nothing restarts it"
    if hang is None and silent:
        raise EngineDied(f"the {engine._where()} stopped answering ({why}); {unwatched}", str(D.ENGINE_SERVICE_DIED))
    loop = asyncio.get_running_loop()
    bound = DYING_GRACE_SECONDS if hang is None else frozen_killed_within(hang) + engine.restart_wait_seconds
    deadline = loop.time() + bound
    if hang is None:
        log.warning("the %s closed the connection and still runs: waiting up to %g s for it to exit", engine._where(), bound)
    else:
        log.warning("the %s is alive but silent: waiting up to %.0f s for its engine job to replace it", engine._where(), bound)
    while True:
        ep = engine._read_endpoint()
        if ep is None or ep.get("pid") != pid or not _alive(pid):
            return
        if loop.time() > deadline:
            if hang is None:
                raise EngineDied(
                    f"the {engine._where()} stopped answering ({why}) and did not exit within {bound:g} s; {unwatched}",
                    str(D.ENGINE_SERVICE_DIED),
                )
            raise EngineDied(
                f"the {engine._where()} stopped answering ({why}) and was not replaced within {bound:.0f} s "
                f"(processors[].hang_seconds={hang:g}, $MIRAGEFLOW_ENGINE_RESTART_WAIT={engine.restart_wait_seconds:g})",
                str(D.ENGINE_SERVICE_DIED),
            )
        await asyncio.sleep(0.2)


def _request_json(request: Request) -> dict:
    body = dataclasses.asdict(request) if not request.images else {**vars(request), "images": [_image_json(i) for i in request.images]}
    return body


def _image_json(image) -> dict:
    """A mirageflow.prompts.images.CanonicalImage as JSON: its bytes in base64, without the decoded copy."""
    d = {f.name: getattr(image, f.name) for f in dataclasses.fields(image) if f.name != "image"}
    d["data"] = base64.b64encode(d["data"]).decode("ascii")
    return d


def _alive(pid) -> bool:
    if not pid:
        return True  # not known yet: keep waiting
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its engine job) is dead too
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux): alive as far as we can tell
        return True
