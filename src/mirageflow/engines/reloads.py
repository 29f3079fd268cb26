"""The reloads of an in-process engine within the job (not an engine): the bookkeeping that
``transformers`` and in-process ``sglang`` share, as engines/server_restarts.py's supervisor
keeps it for a launched server.

``InProcessReloads`` keeps each death (``new_death``: class, time, cause, requests sent
again; the pid is the job's), counts the reloads against ``processors[].max_restarts``,
says how long to wait before the next one (the supervisor's backoff: ``backoff_delay`` from
``ServerSupervisor.restart_base_delay``, doubling up to ``restart_max_delay``), and once the
engine is not reloaded any more makes the one final error: an ``EngineDied`` (or the engine's
subclass) naming every death, with the last death's class (failure.json's ``failure_class``).
The engine does the reload itself (a model reloaded in its worker thread, a new
``sglang.Engine``), and reports ``restarts()`` and ``deaths()`` from here.
"""

from __future__ import annotations

import logging
import os

from mirageflow.engines.base import EngineDied
from mirageflow.engines.server_restarts import ServerSupervisor, new_death
from mirageflow.errors import EngineDeathClass as D
from mirageflow.transport.retry import backoff_delay

log = logging.getLogger(__name__)


class InProcessReloads:
    """The deaths and reloads of one in-process engine, ``name`` ("the transformers model")."""

    def __init__(self, name: str, max_restarts: int):
        self.name, self.max_restarts = name, max_restarts
        self.deaths: list[dict] = []
        self.count = 0  # reloads started (those that failed to start included)
        self.final: EngineDied | None = None  # set: not reloaded any more

    def died(self, death_class: D, cause: str) -> dict:
        """Record a death (an entry of status.json's ``engine_deaths``)."""
        death = new_death(death_class, cause, os.getpid())
        self.deaths.append(death)
        log.error("%s died (%s): %s", self.name, death_class, cause)
        return death

    @property
    def spent(self) -> bool:
        return self.count >= self.max_restarts

    def delay(self) -> float:
        """Seconds to wait before the next reload: the supervisor's backoff for its next restart."""
        return backoff_delay(self.count, ServerSupervisor.restart_base_delay, ServerSupervisor.restart_max_delay)

    def give_up(self, why: str, error_type: type[EngineDied] = EngineDied, detail: str = "") -> EngineDied:
        """The final error (kept in ``final``): every death so far, ``why`` no reload follows,
        then ``detail`` (a log's tail)."""
        listed = "; ".join(f"{i}. {d['at']} {d['class']}: {d['cause']}" for i, d in enumerate(self.deaths, 1))
        self.final = error_type(
            f"{self.name} died {len(self.deaths)} times and was reloaded {self.count} times ({why}): {listed}{detail}",
            self.deaths[-1]["class"],
        )
        return self.final

    def listing(self) -> list[dict]:
        return [dict(d) for d in self.deaths]
