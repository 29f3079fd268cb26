"""``LoopEngine``: the base of the engines that run a private event loop (SGLang in process,
the HTTP backends, the engine service's client).

``LoopEngine`` runs a private asyncio loop in a daemon thread and bridges each
``generate_one`` call into it (``_in_engine_loop``). SGLang's tokenizer manager binds to the
first loop that uses it; with a private loop it works whatever loop, or sequence of
``asyncio.run`` calls, the caller uses. The HTTP engines instead run each request in the
caller's own loop (``_on_caller_loop``): their client (transport/http_client.py) opens its
connections in whichever loop runs it, and a hop to another thread and back costs about
as much CPU as the whole HTTP exchange (BENCHMARKS.md, "HTTP client overhead":
bare_ours_thread_hop against bare_ours); their private loop only serves what is not a
request (health checks before the run, a heartbeat, synchronous calls). Either way
``stop()`` (any thread) and a dying server fail every outstanding request at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from typing import Any, Awaitable

from mirageflow.engines.base import Engine, EngineStopped

log = logging.getLogger(__name__)


class LoopEngine(Engine):
    """An engine whose requests run on a private event loop in a daemon thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()  # outstanding requests, touched only in the loop
        # requests running in callers' loops (_on_caller_loop), per loop, touched only in that loop
        self._caller_tasks: dict[asyncio.AbstractEventLoop, set[asyncio.Task]] = {}
        self._failure: BaseException | None = None  # once set, every request fails with it

    # ------------------------------------------------------------------ loop thread

    def _start_loop(self, name: str) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _call(self, coro: Awaitable, timeout: float | None = None) -> Any:
        """Run a coroutine on the engine loop and wait for it (from a synchronous caller)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _close_client_and_loop(self) -> None:
        """Close the HTTP clients (when the engine has them), then stop the loop: ``_client``
        (requests, in the callers' loops, over by now) at once, ``_control`` on the private loop."""
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
            self._client = None
        control = getattr(self, "_control", None)
        if control is not None and self._loop is not None:
            try:
                self._call(control.aclose(), timeout=10)
            except Exception:  # noqa: BLE001 - closing goes on
                log.debug("closing the HTTP client failed", exc_info=True)
            self._control = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None:
            return

        async def drain() -> None:  # requests and the library's own background tasks
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        try:
            self._call(drain(), timeout=10)
        except Exception:  # noqa: BLE001 - closing goes on
            log.debug("draining the engine loop failed", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    # ------------------------------------------------------------------ requests

    async def _generate(self, request) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _failure_error(self) -> BaseException:
        """A fresh copy of the failure, so concurrent raisers do not share one traceback."""
        error = copy.copy(self._failure)
        error.__traceback__ = None
        return error

    async def generate_one(self, request):
        return await self._in_engine_loop(self._generate, request)

    async def _in_engine_loop(self, fn, *args) -> Any:
        """``await fn(*args)`` in the engine's loop, from the caller's loop."""
        if self._failure is not None:
            raise self._failure_error()
        if self._loop is None:
            raise RuntimeError(f"{type(self).__name__}: load() was not called, or the engine is closed")
        future = asyncio.run_coroutine_threadsafe(self._tracked(fn, *args), self._loop)
        ok, value = await asyncio.wrap_future(future)
        if not ok:
            raise value
        return value

    async def _tracked(self, fn, *args) -> tuple[bool, Any]:
        """(True, result) or (False, exception): an error never stays unretrieved in the
        engine loop when its caller has gone (e.g. cancelled after a sibling failed)."""
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            if self._failure is not None:
                return False, self._failure_error()
            return True, await fn(*args)
        except asyncio.CancelledError:
            if self._failure is not None:
                return False, self._failure_error()
            raise
        except Exception as e:  # noqa: BLE001 - handed to the caller
            return False, e
        finally:
            self._tasks.discard(task)

    async def _on_caller_loop(self, fn, *args) -> Any:
        """``await fn(*args)`` in the caller's loop, failed like ``_in_engine_loop`` by
        ``stop()`` and ``_fail_all`` (the request's task is cancelled, the failure raised)."""
        if self._failure is not None:
            raise self._failure_error()
        task = asyncio.current_task()
        loop = task.get_loop()
        tasks = self._caller_tasks.get(loop)
        if tasks is None:
            for old in [old for old in self._caller_tasks if old.is_closed()]:
                del self._caller_tasks[old]
            tasks = self._caller_tasks[loop] = set()
        tasks.add(task)
        try:
            return await fn(*args)
        except asyncio.CancelledError:
            if self._failure is not None:
                task.uncancel()  # cancelled by _fail_all, not by the caller
                raise self._failure_error() from None
            raise
        finally:
            tasks.discard(task)

    def _fail_all(self, error: BaseException) -> None:
        """From any thread: fail every outstanding and future request with ``error``."""
        if self._failure is None:
            self._failure = error
        loops = [(self._loop, self._tasks)] if self._loop is not None else []
        loops += list(self._caller_tasks.items())
        for loop, tasks in loops:
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(cancel_all, tasks)
                except RuntimeError:  # loop closed meanwhile
                    pass

    def queue_depth(self) -> int:
        return len(self._tasks) + sum(len(tasks) for tasks in list(self._caller_tasks.values()))

    def stop(self) -> None:
        self._fail_all(EngineStopped("engine was stopped"))


def cancel_all(tasks: set[asyncio.Task]) -> None:
    """Cancel each of ``tasks``; run on their loop (``call_soon_threadsafe``)."""
    for task in list(tasks):
        task.cancel()
