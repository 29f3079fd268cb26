"""SIGTERM/SIGINT during a shard run: one context manager for the whole run.

Outside the event loop (engine load, the final commit) a signal raises the exception that
``interrupted(signum)`` builds, where the main thread is. While the event loop runs, the
loop's own signal handling is used instead (``attach``): the handler runs as a callback on
the loop, never in the middle of a coroutine, and the loop stops feeding rows and commits.
Either way ``on_signal`` (stop the engines) runs first. Only the first signal counts: a
second one (a terminal's Ctrl-C reaches the job with its group, and the driver forwards the
same signal to its jobs: mirageflow/cluster/snakemake_internals.py) is logged and ignored, so
it cannot break off the commit the first one started. On exit the previous handlers are
restored.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self, on_signal: Callable[[int], None], interrupted: Callable[[int], BaseException]):
        self.on_signal, self.interrupted = on_signal, interrupted
        self.signum: int | None = None
        self._previous: dict = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active = threading.current_thread() is threading.main_thread()

    def _received(self, signum: int) -> bool:
        """Record the signal; False when one was received already (the stop is under way)."""
        if self.signum is not None:
            log.warning("received %s again: still committing and stopping", signal.Signals(signum).name)
            return False
        log.warning("received %s: committing finished rows and stopping", signal.Signals(signum).name)
        self.signum = signum
        self.on_signal(signum)
        return True

    def _raise(self, signum, frame) -> None:
        if self._received(signum):
            raise self.interrupted(signum)

    def __enter__(self) -> "StopSignals":
        if self._active:
            self._previous = {s: signal.signal(s, self._raise) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self.detach()
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def attach(self, loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
        """While ``loop`` runs, a signal calls ``stop()`` on it instead of raising."""
        if not self._active:
            return

        def on_loop(signum: int) -> None:
            if self._received(signum):
                stop()

        for s in SIGNALS:
            loop.add_signal_handler(s, on_loop, s)
        self._loop = loop

    def detach(self) -> None:
        """Back to raising (removing a loop handler resets the signal to its default)."""
        if self._loop is None:
            return
        for s in SIGNALS:
            self._loop.remove_signal_handler(s)
            signal.signal(s, self._raise)
        self._loop = None
