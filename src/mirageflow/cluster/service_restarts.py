"""The ``engine`` rule's job keeps its engine service alive: a dead service is replaced in the job.

The job Snakemake runs and terminates (``python -m mirageflow.jobs ... engine G ENDPOINT``) is
a small process that loads nothing: it launches the serving process (``engine-process``, which
runs cluster/engine_service.py ``run``) as a launched server of its own, with the project's one
launcher and restarter (engines/server_process.py ``ServerProcess`` under
engines/server_restarts.py ``ServerSupervisor``: ready when ``GET /health`` answers 200). So
the service job stays what Snakemake started and stops (no second scheduler, no process
outliving it), and the process that holds the model, the one that dies of a device error or
the OOM killer, is the one replaced:

- A serving process that exits while serving is a death (classified from its exit status and
  its log: killed by a signal, out of memory, exited with an error). The job writes the
  endpoint file at once with ``state: restarting``, its own pid (alive: the shards wait for
  the successor, engines/shared.py) and ``deaths``, the list of the service's deaths so far;
  after the backoff the successor loads, names itself in the endpoint file (carrying
  ``deaths``) and the shards resend the requests the dead one held.
- The replacements count against ``max_restarts`` (processors[].max_restarts, the smallest
  among the processors the service serves: none is reloaded more often than it allows).
  The next death after the last one is final: the endpoint file says ``state: died`` with an
  error naming each death, its shards fail ``engine_service_died``, and the job exits 1.
- A serving process that answers neither a request nor ``GET /health`` for ``hang_seconds``
  (processors[].hang_seconds, the smallest non-null among the processors the service serves;
  all null: never watched) is frozen: the supervisor's watchdog kills its process tree with
  SIGKILL and it is replaced as a dead one, a death of class ``frozen``. Its shards, which find
  it alive but silent, wait for the successor meanwhile (engines/shared.py). Its ``/health`` is
  answered by the serving process's event loop while its engines generate in their own threads
  (cluster/engine_service.py), so a busy service is not taken for a frozen one.
- A serving process that exits 0 left by itself (idle for ``$MIRAGEFLOW_ENGINE_IDLE_EXIT``):
  the job ends too. SIGTERM (Snakemake, once the shards are done) stops the serving process
  (SIGTERM, SIGKILL after a grace) and the job exits 0. A job killed outright (SIGKILL) cannot
  stop it: the serving process, in a session of its own, notices within a second that its
  parent is gone and stops as on SIGTERM (cluster/engine_service.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from mirageflow.cluster.engine_groups import served_processors
from mirageflow.config.types import PipelineConfig
from mirageflow.engines.base import EngineDied, EngineStopped
from mirageflow.engines.server_restarts import ServerSupervisor
from mirageflow.engines.shared import HEARTBEAT_SECONDS, WAIT_SECONDS
from mirageflow.errors import MirageflowError
from mirageflow.files import atomic_write_json

log = logging.getLogger(__name__)

KILL_GRACE_SECONDS = 15.0  # a serving process writes its stats on SIGTERM; then SIGKILL
# after the last death the "died" endpoint stays this long (or until SIGTERM): the shards, which
# notice a death on their next request or heartbeat, read why before the job's end removes it
DIED_LINGER_SECONDS = 2 * HEARTBEAT_SECONDS


class _Stop(MirageflowError):
    """SIGTERM/SIGINT reached the job."""


def max_replacements(cfg: PipelineConfig) -> int:
    """How many times the service of ``cfg`` is replaced in one job (see the module's doc)."""
    return min(cfg.processors[name].max_restarts for name in served_processors(cfg))


def service_hang_seconds(cfg: PipelineConfig) -> float | None:
    """After how many silent seconds the service of ``cfg`` is frozen (see the module's doc)."""
    watched = [cfg.processors[name].hang_seconds for name in served_processors(cfg)]
    return min((h for h in watched if h is not None), default=None)


def serve_with_replacements(cfg: PipelineConfig, config_path: str, group: int, endpoint: str | Path, log_path: str) -> None:
    """The engine job: launch the serving process of ``group`` and replace it when it dies, until
    SIGTERM. Raises when the first one fails to load, and EngineDied once the replacements are spent."""
    endpoint = Path(endpoint)

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "mirageflow.jobs", "--config", config_path, "--log", log_path,
            "engine-process", str(group), str(endpoint), "--port", str(port), "--parent", str(os.getpid()),
        ]  # fmt: skip

    supervisor = ServerSupervisor(
        f"the engine service of group {group}", command, Path(log_path), None, host="127.0.0.1", ready_path="/health",
        probe_path="/health", start_timeout=float(os.environ.get("MIRAGEFLOW_ENGINE_WAIT", WAIT_SECONDS)),
        start_timeout_name="$MIRAGEFLOW_ENGINE_WAIT", poll_interval=0.2, kill_grace=KILL_GRACE_SECONDS,
        max_restarts=max_replacements(cfg), hang_seconds=service_hang_seconds(cfg),
    )  # fmt: skip
    ended = threading.Event()  # the serving process left by itself, or no replacement follows

    def write(state: str, error: str | None = None) -> None:
        atomic_write_json(endpoint, {
            "group": group, "state": state, "error": error, "hostname": socket.gethostname(), "pid": os.getpid(),
            "log": log_path, "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "deaths": supervisor.deaths,
        })  # fmt: skip

    def on_death() -> None:
        if not supervisor.armed:  # loading failed: the serving process wrote why in the endpoint file
            return
        if supervisor.server.poll() == 0:  # it left by itself (idle): not a death, nothing to replace
            supervisor.deaths.pop()
            supervisor.stop()
            ended.set()
            return
        write("restarting")

    def on_final(error: BaseException) -> None:
        if supervisor.armed and not isinstance(error, EngineStopped):
            write("died", str(error))
        ended.set()

    supervisor.on_death, supervisor.on_final = on_death, on_final

    def on_signal(signum, frame) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        supervisor.start_process()
        _wait_named_ready(endpoint, supervisor.server, supervisor.start_timeout)
        supervisor.wait_started()  # EngineError when it exited before it was ready (its error is in the endpoint file)
        supervisor.watch()
        ended.wait()
        if isinstance(supervisor.final, EngineDied):  # the replacements are spent
            ended.clear()
            ended.wait(DIED_LINGER_SECONDS)
            raise supervisor.final
    except _Stop as stop:
        log.info("engine group %d: %s, stopping the serving process", group, stop)
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        supervisor.kill()


def _wait_named_ready(endpoint: Path, server, timeout: float) -> None:
    """Until the first serving process says ready (or failed) in the endpoint file, or exits, or
    ``timeout`` passes (``wait_started`` then says so). Its shards start at that moment; the job,
    armed only once ``wait_started``'s probe answered, must not lag behind them by its probe's
    growing interval (a death in between would end the job)."""
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        try:
            ep = json.loads(endpoint.read_text())
        except (OSError, ValueError):
            ep = {}
        if ep.get("pid") == server.pid and ep.get("state") in ("ready", "failed"):
            return
        time.sleep(0.05)
