"""An in-process model's deaths and reloads within the job: the one reload mechanism of the
transformers engine's two paths (its static batches and its continuous-batching manager).

An error the model raises is classified once (server_process.classify_engine_error): a device
error (a CUDA error, a device-side assert) reloads the model, up to ``max_restarts`` times, and
only the work not yet handed back runs again; out of memory is not reloaded (the same work
would run out again); anything else is a bug and is raised as it is. Each death is an entry
of ``engine_deaths`` (server_restarts.new_death, as a launched server's), each reload one of
``engine_restarts``; the death after the limit ends the model for good (``final``: an
EngineDied naming every death, with the last one's class for failure.json). That bookkeeping
is reloads.InProcessReloads', shared with in-process SGLang; this class adds what the
transformers model needs on top: running work again after a reload, and the generations.

Both paths may see one death (they share the model): the model's ``generation`` counts its
reloads, and work that ran on a generation already replaced runs again on the new model
without counting a second death (its rows count in the death's ``requests_resent``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from mirageflow.engines.reloads import InProcessReloads
from mirageflow.engines.server_process import classify_engine_error
from mirageflow.errors import EngineDeathClass as D

log = logging.getLogger(__name__)


class ModelReloads(InProcessReloads):
    """The deaths and reloads of one in-process model. ``reload()``: load it again (called
    with the reload lock held, so no second reload starts meanwhile); ``stopped``: set when the
    engine is stopped (an error then is not a death)."""

    def __init__(self, max_restarts: int, reload: Callable[[], None], stopped: threading.Event, name: str = "the transformers model"):
        super().__init__(name, max_restarts)
        self._reload = reload
        self._stopped = stopped
        self.generation = 0  # the loaded model's: one more at each reload
        self._ended_by: dict[int, dict] = {}  # generation -> the death that ended it
        self._lock = threading.Lock()

    def run(self, items: list, attempt: Callable[[list, Callable], list], hand_back: Callable[[int, object], None]) -> list:
        """The results of ``items`` (a static batch): ``attempt(items, early)`` runs them and
        calls ``early(j, result)`` for each that finishes before the others (handed back at
        once through ``hand_back(i, result)``). After a death the model is reloaded and only
        the items not handed back yet run again."""
        results: list = [None] * len(items)
        pending = list(range(len(items)))
        while True:
            generation = self.generation
            handed: set[int] = set()

            def early(j: int, result, pending=pending, handed=handed) -> None:
                handed.add(pending[j])
                results[pending[j]] = result
                hand_back(pending[j], result)

            try:
                for j, result in enumerate(attempt([items[i] for i in pending], early)):
                    results[pending[j]] = result
                return results
            except Exception as e:  # noqa: BLE001 - classified: a death is healed, anything else raised
                pending = [i for i in pending if i not in handed]
                self.heal(e, len(pending), generation)

    async def run_one(self, attempt: Callable[[], Awaitable], cause: Callable[[Exception], Exception] = lambda e: e):
        """The result of one request sent alone (continuous batching): ``attempt()`` again on
        the reloaded model after a death. ``cause(error)``: the exception that killed the model
        behind a request's failure (may wait for it); the reload runs off the event loop."""
        while True:
            generation = self.generation
            try:
                return await attempt()
            except Exception as e:  # noqa: BLE001 - classified: a death is healed, anything else raised
                await asyncio.to_thread(lambda e=e: self.heal(cause(e), 1, generation))

    def heal(self, error: Exception, rerun: int, generation: int) -> None:
        """``error`` ended work (``rerun`` items to run again) that ran on the model of
        ``generation``: return once the model is usable again (reloaded, here or since), else
        raise (EngineDied for a death, with its class; the error itself when it is no death)."""
        with self._lock:
            if self.final is not None:  # dead for good: every later failure is this one
                raise self.final from error
            if self._stopped.is_set():
                raise error
            if generation != self.generation:  # ran on a model replaced since: run again on the new one
                self._ended_by[generation]["requests_resent"] += rerun
                return
            found = classify_engine_error(error)
            if found is None:
                raise error
            death_class, cause = found
            death = self.died(death_class, cause)
            if death_class is not D.DEVICE_ERROR:
                why = "out of memory: not reloaded, the same batch would run out again"
            elif self.spent:
                why = f"processors[].max_restarts={self.max_restarts} spent"
            else:
                why = None
            if why is not None:
                raise self.give_up(why) from error
            t0 = time.monotonic()
            self._reload()
            self.count += 1
            self._ended_by[generation] = death
            self.generation += 1
            death["requests_resent"] = rerun
            death["restarted_after_seconds"] = death["successor_start_seconds"] = round(time.monotonic() - t0, 3)
            log.warning(
                "%s was reloaded in %.1f s (reload %d of at most %d); %d requests run again",
                self.name, time.monotonic() - t0, self.count, self.max_restarts, rerun,
            )  # fmt: skip
