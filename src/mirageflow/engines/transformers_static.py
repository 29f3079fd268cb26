"""The transformers engine's static path: requests arrive one by one from the runner's
in-flight window, and a worker thread forms the batches that transformers_generate.py runs.

The worker takes whatever is waiting (up to ``batch_size``, requests that can share one
``generate`` call: they differ at most in ``max_new_tokens``), runs a left-padded batch, and
resolves each request's future. A batch holds fewer rows when its rows' limits would keep it
running past half the runner's commit interval (batch_time.py), so a stop loses at most one
interval of work. While a batch runs the window refills the queue, so the next batch is full
as soon as the model is free, and a full batch starts at once (only a short one waits a few
ms for more requests). A batch that raises an error leaving the model unusable goes through
the engine's ModelReloads (model_reloads.py): the model is reloaded and the rows of the batch
not yet handed back run again.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections import deque

from mirageflow.engines.base import EngineStopped
from mirageflow.engines.transformers_generate import max_new_tokens
from mirageflow.engines.wire import Completion, Request

_LINGER_SECONDS = 0.005  # a short batch waits this long after each arrival for more requests


def _batch_key(params: dict) -> str:
    """Requests may share a generate() call when they differ at most in max_new_tokens."""
    return json.dumps({k: v for k, v in params.items() if k != "max_new_tokens"}, sort_keys=True)


class StaticBatcher:
    """The queue of ``engine``'s static path and the worker thread that empties it."""

    def __init__(self, engine):
        self.engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._running = 0

    def start(self) -> None:
        self._worker = threading.Thread(target=self._serve, name="transformers-batcher", daemon=True)
        self._worker.start()

    async def generate(self, request: Request) -> Completion:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        key = _batch_key(request.sampling_params) + ("\0images" if request.images else "")  # image rows batch apart
        self._queue.put((request, future, loop, key))
        return await future

    def depth(self) -> int:
        return self._queue.qsize() + self._running

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=30)
            self._worker = None

    def _next_batch(self, backlog: deque) -> list | None:
        """Up to batch_size waiting requests that can share a generate() call; None to exit.

        A full batch starts at once; a short one waits up to _LINGER_SECONDS after each
        arrival for more (the window refills while the previous batch runs).
        """
        batch_size = self.engine.batch_size
        if not backlog:
            item = self._queue.get()
            if item is None:
                return None
            backlog.append(item)
        key = backlog[0][3]
        matching = sum(1 for item in backlog if item[3] == key)
        deadline = time.monotonic() + _LINGER_SECONDS
        while matching < batch_size and len(backlog) < 4 * batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # exit after serving what is here
                break
            backlog.append(item)
            matching += item[3] == key
            deadline = time.monotonic() + _LINGER_SECONDS
        batch, rest = [], deque()
        while backlog:
            item = backlog.popleft()
            (batch if len(batch) < batch_size and item[3] == key else rest).append(item)
        cap = self.engine.cap.rows(max(max_new_tokens(item[0]) for item in batch))
        backlog.extend(batch[cap:])  # first in the next batch
        backlog.extend(rest)
        return batch[:cap]

    def _serve(self) -> None:
        engine = self.engine
        backlog: deque = deque()
        while (batch := self._next_batch(backlog)) is not None:
            self._running = len(batch)

            def hand_back(i: int, result, batch=batch) -> None:
                _, future, loop, _ = batch[i]
                deliver(future, loop, result)

            def attempt(items: list, early) -> list:
                return engine.generator.run([item[0] for item in items], early)

            try:
                if engine.stopped.is_set():
                    raise EngineStopped("engine was stopped")
                if engine.reloads.final is not None:  # the model died for good: later batches fail the same way, not run
                    raise engine.reloads.final
                results = engine.reloads.run(batch, attempt, hand_back)
            except BaseException as e:  # resolve every waiter; never leave a future hanging
                results = [e] * len(batch)
            finally:
                self._running = 0
            for i, result in enumerate(results):  # a row handed back while the batch ran is not resolved again
                hand_back(i, result)


def deliver(future: asyncio.Future, loop, result) -> None:
    """Resolve ``future`` (of ``loop``, the caller's) from a worker thread with ``result``, an
    exception or a completion; both transformers paths hand their answers back through it."""

    def resolve() -> None:
        if future.done():  # the waiter was cancelled (shutdown)
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop is closed (the shard stopped): nobody waits
        pass
