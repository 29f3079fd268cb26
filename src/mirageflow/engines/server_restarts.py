"""A launched inference server that the job restarts when it dies or freezes (not an engine):
the healing half of ``sglang_server``, ``vllm_server`` and image_gen's SGLang diffusion server
(imagegen/http_images.py), around the one launcher
(engines/server_process.py).

``ServerSupervisor`` starts the server (a ``ServerProcess``) on a free port, and from the
end of the engine's load (``watch``):

- Death: the process exits (its watch thread's ``on_exit``), or it answers neither a request
  nor ``GET <probe_path>`` for ``hang_seconds`` (a watchdog thread probes every
  ``hang_seconds / 5``, at most every 5 s; the frozen server's process tree is killed with
  SIGKILL). Each death is classified (``EngineDeathClass``: out of memory, killed by a
  signal, exited with an error, frozen, failed to start; server_process.classify_exit) and
  kept in ``deaths`` (class, time, cause, exit code, requests sent again).
- Restart, in a thread of its own: the dead server's process tree is swept (a child that
  outlived it holds the GPU and the port), then after ``backoff_delay`` (transport/retry.py:
  1 s doubling up to 30 s, half of it random) a new server on a new free port must answer
  its ready probe within ``server_start_timeout``; ``on_restarted(server, base_url)`` then points the
  engine's client at it. A restart that does not become healthy is a ``failed_to_start``
  death, and the next restart follows. Once ``max_restarts`` restarts are spent the next
  death is final: ``ServerDied`` naming the cause of every death, ``death_class`` the last's.
- Requests: ``call(send)`` sends one and, when the server it went to died meanwhile, waits for
  the successor and sends the same request again (its seed, its ``n``): counted in that
  death's ``requests_resent``. A request that comes while a restart is under way waits for it
  (not counted). An answered request is never sent again.
- ``stop()`` (SIGTERM) and ``close()``: no more restarts; requests waiting for one fail.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from concurrent.futures import Future
from datetime import datetime, timezone
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from mirageflow.engines.base import EngineDied, EngineStopped
from mirageflow.engines.server_process import LOG_TAIL_LINES, ServerProcess
from mirageflow.engines.server_ranks import NodeSpan, RankFlags
from mirageflow.errors import EngineDeathClass as D
from mirageflow.transport.retry import backoff_delay

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_RESTARTS = 3  # processors[].max_restarts: null (the schema's default)
# processors[].hang_seconds: null. A serving vLLM or SGLang answers its health probe within a
# second even when its queue is full (the API server's event loop answers it, not the GPU),
# so five minutes of silence is no slow batch; it is short beside a job of hours.
DEFAULT_HANG_SECONDS = 300.0
PROBE_MAX_INTERVAL = 5.0


def hang_probe(hang_seconds: float) -> tuple[float, float]:
    """The hang watchdog's probe interval and each probe's deadline for ``hang_seconds``."""
    return min(PROBE_MAX_INTERVAL, hang_seconds / 5), max(0.2, min(30.0, hang_seconds / 2))


def frozen_killed_within(hang_seconds: float) -> float:
    """The longest a frozen server lives once it last answered: the watchdog finds it silent for
    ``hang_seconds`` at its first probe after that, which is at most an interval plus a deadline
    later (engines/shared.py waits this long for a frozen engine service to be replaced)."""
    interval, timeout = hang_probe(hang_seconds)
    return hang_seconds + interval + timeout


class ServerDied(EngineDied):
    """The launched server died and is not restarted: ``max_restarts`` is spent, or the job
    was not yet serving. ``death_class``: the last death's class (an EngineDeathClass value)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def new_death(death_class: D, cause: str, pid: int | None = None, exit_code: int | None = None) -> dict:
    """One entry of ``engine_deaths`` (status.json): a launched server's death, or an in-process
    engine's (its pid is the job's, no exit code)."""
    return {
        "class": str(death_class),
        "at": _now(),
        "cause": cause,
        "exit_code": exit_code,
        "pid": pid,
        "requests_resent": 0,
        "restarted_after_seconds": None,  # from the death to the successor's first healthy answer
        "successor_start_seconds": None,  # of which the successor's own start (the rest: sweep and backoff)
        "first_answer_after_seconds": None,  # from the death to the successor's first answer to a request
    }


class ServerSupervisor:
    """One launched server, restarted in the job. ``make_command(port)``: its command line."""

    restart_base_delay = 1.0
    restart_max_delay = 30.0

    def __init__(
        self, name: str, make_command: Callable[[int], list[str]], log_path: Path, env: dict | None, *, host: str,
        ready_path: str, probe_path: str, start_timeout: float, poll_interval: float, kill_grace: float,
        max_restarts: int, hang_seconds: float | None, start_timeout_name: str = "server_start_timeout",
        span: NodeSpan | None = None, rank_flags: RankFlags | None = None,
    ):  # fmt: skip
        self.name, self.make_command, self.log_path, self.env, self.host = name, make_command, Path(log_path), env, host
        # an engine across nodes (execution_params.nodes > 1): every start is rank 0 here and srun's ranks elsewhere
        self.span, self.rank_flags = span, rank_flags
        self.ready_path, self.probe_path = ready_path, probe_path
        self.start_timeout, self.poll_interval, self.kill_grace = start_timeout, poll_interval, kill_grace
        self.start_timeout_name = start_timeout_name  # the config key of start_timeout, named when it passes
        self.max_restarts, self.hang_seconds = max_restarts, hang_seconds
        # the engine's hooks: a death (its figures of the dead server end), a successor serving at
        # base_url (its client points there), no successor (fail every request in flight now)
        self.on_death: Callable[[], None] | None = None
        self.on_restarted: Callable[[ServerProcess, str], None] | None = None
        self.on_final: Callable[[BaseException], None] | None = None
        self.server: ServerProcess | None = None  # the one serving (or the dead one, during a restart)
        self.port: int | None = None
        self.command: list[str] = []
        self.generation = 0  # servers that served before this one
        self.restarts = 0  # starts after the first (those that failed to start included)
        self.deaths: list[dict] = []
        self.final: BaseException | None = None  # set: no more restarts, every request fails with it
        self._death_of: dict[int, dict] = {}  # generation -> the death that ended it
        self._died_at: dict[int, float] = {}  # generation -> when it died (monotonic)
        self._successor: Future = Future()  # done when the serving server's successor serves (or never will)
        self._dying = False  # the serving server died; its successor is not serving yet
        self.armed = False  # serving (watch called): a death is restarted
        self._closing = False
        self._wake = threading.Event()  # set by stop/close: the watchdog and a restart's backoff end
        self._lock = threading.Lock()
        self._last_alive = time.monotonic()
        self._candidates: list[ServerProcess] = []  # started, not yet known healthy (close kills them)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ starts

    def _launch(self) -> tuple[ServerProcess, int, list[str]]:
        from mirageflow.engines.http import free_port

        port = free_port(self.host)
        command = self.make_command(port)
        if self.span is not None:  # the ranks meet at a port of this node, on every interface
            server = self.span.server(self.name, command, self.log_path, self.env, self.rank_flags, free_port("0.0.0.0"))
            command = server.command
        else:
            server = ServerProcess(self.name, command, self.log_path, self.env)
        with self._lock:
            if self._closing:
                raise EngineStopped(f"{self.name} was not restarted: the engine is stopping")
            server.start(on_exit=lambda rc: self._exited(server, rc))
            self._candidates.append(server)
        return server, port, command

    def start(self) -> float:
        """The first start (the engine's load): seconds until the ready probe answered 200.
        EngineError when it exits first or ``start_timeout`` passes (the caller closes)."""
        self.start_process()
        return self.wait_started()

    def start_process(self) -> None:
        """``start``'s first half: the process runs (the engine may load its tokenizer meanwhile)."""
        self.server, self.port, self.command = self._launch()

    def wait_started(self) -> float:
        """``start``'s second half: the wait for the ready probe."""
        started = self.server.wait_healthy(
            self.base_url, self.ready_path, self.start_timeout, self.poll_interval, timeout_name=self.start_timeout_name
        )  # fmt: skip
        self._candidates.remove(self.server)
        return started

    def watch(self) -> None:
        """Serving from now on (the engine loaded): deaths are restarted, hangs watched for."""
        self.armed = True
        self._last_alive = time.monotonic()
        if self.hang_seconds:
            threading.Thread(target=self._watch_hang, name=f"{self.name}-hang-watch", daemon=True).start()
        rc = self.server.poll()
        if rc is not None:  # died while the engine finished loading
            self._exited(self.server, rc)

    # ------------------------------------------------------------------ deaths

    def _exited(self, server: ServerProcess, rc: int) -> None:
        """The watch thread of ``server``: it exited while nobody stopped it."""
        if server is not self.server:  # a restart that had not become healthy: its wait_healthy says why
            return
        death_class, cause = server.exit_cause(rc)
        self._died(server, death_class, cause, rc)

    def _died(self, server: ServerProcess, death_class: D, cause: str, exit_code: int | None = None) -> None:
        with self._lock:
            if server is not self.server or self._dying or self._closing or self.final is not None:
                return
            self._dying = True
            generation = self.generation
        death = self._record(death_class, cause, server, exit_code)
        self._death_of[generation] = death
        self._died_at[generation] = time.monotonic()
        log.error("%s (pid %s) died (%s): %s; log: %s", self.name, server.pid, death_class, cause, self.log_path)
        if self.on_death is not None:
            self.on_death()
        if not self.armed:  # the engine was still loading: its load fails, as without restarts
            self._give_up(server)
            return
        threading.Thread(target=self._heal, args=(server, death), name=f"{self.name}-restart", daemon=True).start()

    def _record(self, death_class: D, cause: str, server: ServerProcess | None, exit_code: int | None) -> dict:
        death = new_death(death_class, cause, server.pid if server is not None else None, exit_code)
        self.deaths.append(death)
        return death

    def _heal(self, dead: ServerProcess, death: dict) -> None:
        """The restart thread: sweep the dead server's tree, start successors until one serves
        or the restarts are spent."""
        t0 = self._died_at[self.generation]
        dead.kill(0.0 if death["class"] == D.FROZEN else self.kill_grace)
        last = dead
        while True:
            if self.restarts >= self.max_restarts or self._closing:
                self._give_up(last)
                return
            if self._wake.wait(backoff_delay(self.restarts, self.restart_base_delay, self.restart_max_delay)):
                self._give_up(last)
                return
            self.restarts += 1
            server = None
            try:
                server, port, command = self._launch()
                log.info("restarting %s (restart %d of at most %d) on port %d", self.name, self.restarts, self.max_restarts, port)
                started = server.wait_healthy(
                    f"http://{self.host}:{port}", self.ready_path, self.start_timeout, self.poll_interval,
                    timeout_name=self.start_timeout_name,
                )  # fmt: skip
                if self.on_restarted is not None:
                    self.on_restarted(server, f"http://{self.host}:{port}")
            except Exception as e:  # noqa: BLE001 - a restart that failed is a death of its own
                if server is not None:
                    server.kill(self.kill_grace)
                if self._closing:
                    self._give_up(last)
                    return
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._record(D.FAILED_TO_START, first, server, server.poll() if server is not None else None)
                log.error("%s failed to start again: %s", self.name, first)
                last = server or last
                continue
            with self._lock:
                if self._closing:
                    closing = True
                else:
                    closing = False
                    self._candidates.remove(server)
                    self.server, self.port, self.command = server, port, command
                    successor, self._successor = self._successor, Future()
                    self.generation += 1
                    self._dying = False
                    self._last_alive = time.monotonic()
            if closing:
                server.kill(self.kill_grace)
                self._give_up(last)
                return
            death["restarted_after_seconds"] = round(time.monotonic() - t0, 3)
            death["successor_start_seconds"] = round(started, 3)
            log.warning("%s serves again after %.1f s (pid %d)", self.name, time.monotonic() - t0, server.pid)
            successor.set_result(None)
            return

    def _give_up(self, last: ServerProcess) -> None:
        """No more restarts: every waiting and later request fails."""
        with self._lock:
            if self.final is None:
                self.final = (
                    EngineStopped(f"{self.name} was not restarted: the engine is stopping") if self._closing else _final_error(self, last)
                )
            final = self.final
        if not self._successor.done():
            self._successor.set_exception(final)
        if self.on_final is not None:
            self.on_final(final)

    # ------------------------------------------------------------------ hangs

    def _watch_hang(self) -> None:
        """Probe the serving server; kill it as frozen once neither a request nor a probe was
        answered for ``hang_seconds``."""
        from mirageflow.transport.http_client import get_blocking

        hang = float(self.hang_seconds)
        interval, timeout = hang_probe(hang)
        while not self._wake.wait(interval):
            with self._lock:
                server, url, dying = self.server, self.base_url + self.probe_path, self._dying
            if dying or self.final is not None:
                continue
            try:
                if get_blocking(url, timeout).status_code == 200:
                    self._last_alive = time.monotonic()
                    continue
            except Exception:  # noqa: BLE001 - no answer is what is watched for
                pass
            silent = time.monotonic() - self._last_alive
            if silent > hang and server.poll() is None:
                self._died(
                    server,
                    D.FROZEN,
                    f"answered neither a request nor GET {self.probe_path} for {silent:.0f} s (processors[].hang_seconds={hang:g})",
                )

    # ------------------------------------------------------------------ requests

    async def call(self, send: Callable[[], Awaitable[T]]) -> T:
        """``await send()``, sent again to the successor when the server it went to died meanwhile."""
        while True:
            if self.final is not None:
                raise _fresh(self.final)
            generation, successor = self.generation, self._successor
            if self._dying:  # a restart is under way: wait for it, then send
                await wait_future(successor)
                continue
            try:
                answer = await send()
            except Exception:
                if not await self._lost_soon(generation):
                    raise
                if generation == self.generation:
                    await wait_future(successor)  # raises the final error when there is no successor
                death = self._death_of.get(generation)
                if death is not None:
                    death["requests_resent"] += 1
                continue
            self._last_alive = time.monotonic()
            if generation and self._death_of[generation - 1]["first_answer_after_seconds"] is None:
                self._death_of[generation - 1]["first_answer_after_seconds"] = round(self._last_alive - self._died_at[generation - 1], 3)
            return answer

    async def check_alive(self, server: ServerProcess) -> None:
        """After a connection error to ``server``: ServerDied when it died (or is dying), so the
        request is not retried against it but sent to its successor (``call``)."""
        for _ in range(5):  # the socket may close a moment before the exit is seen
            if server.poll() is not None or server is not self.server or self._dying:
                break
            await asyncio.sleep(0.05)
        rc = server.poll()
        if rc is not None or server is not self.server or self._dying:
            raise ServerDied(f"{self.name} (pid {server.pid}) died during the request" + (f" (exit code {rc})" if rc is not None else ""))

    async def _lost_soon(self, generation: int) -> bool:
        """``_lost``, waiting up to a second for it: a connection is reset as the server dies,
        a moment before its exit is seen (the watch thread reaps it)."""
        for _ in range(20):
            if self._lost(generation):
                return True
            await asyncio.sleep(0.05)
        return False

    def _lost(self, generation: int) -> bool:
        """Whether the server of ``generation`` died (it may not be known dead yet: its exit is)."""
        return generation != self.generation or self._dying or (self.server is not None and self.server.poll() is not None)

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """SIGTERM reached the job, or the engine closes: no more restarts (a restart under way
        gives up), and requests from now on fail with EngineStopped (or the final death)."""
        self._closing = True
        self._wake.set()
        with self._lock:
            if self.final is None:
                self.final = EngineStopped(f"{self.name} is stopping: it is not restarted")
            final = self.final
        if not self._successor.done():
            self._successor.set_exception(final)

    def kill(self) -> None:
        """Stop restarting and kill every server process this supervisor started."""
        self.stop()
        with self._lock:
            servers = [s for s in (self.server, *self._candidates) if s is not None]
        for server in servers:
            server.closing = True
        for server in servers:
            server.kill(self.kill_grace)


class Restartable:
    """The restarts and deaths so far of what holds a ``supervisor`` (None before load): an
    engine that launches its server, or image_gen's SGLang diffusion server (``ShardMetrics``
    reads them)."""

    supervisor: ServerSupervisor | None = None

    def restarts(self) -> int:
        return self.supervisor.restarts if self.supervisor is not None else 0

    def deaths(self) -> list[dict]:
        return [dict(d) for d in self.supervisor.deaths] if self.supervisor is not None else []


class Supervised(Restartable):
    """What an engine that launches its server (sglang_server, vllm_server) shows of it, through
    its ``supervisor``: the server serving now, its port, command and URL. Needs ``self.host``."""

    host: str

    @property
    def server(self) -> ServerProcess | None:
        """The server serving now (the dead one while a restart is under way)."""
        return self.supervisor.server if self.supervisor is not None else None

    @property
    def port(self) -> int | None:
        return self.supervisor.port if self.supervisor is not None else None

    @property
    def command(self) -> list[str]:
        return self.supervisor.command if self.supervisor is not None else []

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def process(self):
        """The server's Popen (None before load)."""
        return self.server.process if self.server is not None else None


def _final_error(supervisor: ServerSupervisor, last: ServerProcess) -> ServerDied:
    """The death no restart follows, naming each death (time, class, cause) and ``last``'s log tail."""
    s, death = supervisor, supervisor.deaths[-1]
    where = f"last {LOG_TAIL_LINES} lines of {s.log_path}:\n{last.tail()}"
    if len(s.deaths) == 1:
        why = f" (processors[].max_restarts={s.max_restarts}: not restarted)" if s.armed else ""
        return ServerDied(f"{s.name} (pid {death['pid']}) {death['cause']} during the run{why}; {where}", death["class"])
    listed = "; ".join(f"{i}. {d['at']} {d['class']}: {d['cause']}" for i, d in enumerate(s.deaths, 1))
    return ServerDied(
        f"{s.name} died {len(s.deaths)} times during the run and was restarted {s.restarts} times, the most "
        f"processors[].max_restarts={s.max_restarts} allows: {listed}; {where}",
        death["class"],
    )


def _fresh(error: BaseException) -> BaseException:
    """A copy of a shared error, so concurrent raisers do not share one traceback."""
    error = copy.copy(error)
    error.__traceback__ = None
    return error


async def wait_future(future: Future) -> None:
    """Wait in this event loop for ``future`` (set from a restart thread) without cancelling it
    when this waiter is cancelled (asyncio.wrap_future would: other requests wait on it too)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(done: Future) -> None:
        if waiter.done():
            return
        error = done.exception()
        if error is not None:
            waiter.set_exception(_fresh(error))
        else:
            waiter.set_result(None)

    def done_callback(done: Future) -> None:
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # the waiter's loop closed meanwhile
            pass

    future.add_done_callback(done_callback)
    await waiter
