"""Fake engines for the benchmarks, all implementing mirageflow's Engine interface.

- ``InstantEngine``: answers every request at once with a fixed completion (and fixed token
  counts); the chat template is the real tokenizer's. Measures the pipeline around the engine.
- ``SimulatedBatchEngine``: a continuous-batching engine (capacity C sequences, one decode
  step of fixed duration advances every running sequence by one token, output lengths fixed
  per request id). Measures how well a feeder keeps it full.
- ``SlowEngine``: answers after a short random delay and can log each finished request id
  (one line, O_APPEND, unbuffered) so a SIGKILLed run still tells which rows it finished.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
import os
import random
import time

from mirageflow.engines.base import Engine

from mirageflow.engines.wire import Completion, EngineInfo, Request


class _TokenizerEngine(Engine):
    """Loads a tokenizer for its chat template.

    ``chat="fast"`` uses the Engine base class's compiled chat template (what our engines
    use); ``chat="transformers"`` calls ``tokenizer.apply_chat_template`` on every row (what
    MMIRAGE does, and what our engines did before the fast path).
    """

    def __init__(self, tokenizer_path: str | None, chat: str = "fast", max_inflight: int = 256):
        self.tokenizer_path, self.chat = tokenizer_path, chat
        self.max_inflight = max_inflight
        self.tokenizer = None
        self.info = EngineInfo(backend=type(self).__name__, model_path=str(tokenizer_path))

    load_cpu_seconds = 0.0  # CPU time spent in load(), so benchmarks can leave it out

    def load(self) -> None:
        t0 = time.process_time()
        if self.tokenizer_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.load_cpu_seconds = time.process_time() - t0

    def chat_prompt(self, messages, chat_template_kwargs) -> str:
        if self.chat == "transformers":
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs)
        if self.chat == "none":  # no tokenizer: a trivial template
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return super().chat_prompt(messages, chat_template_kwargs)


class InstantEngine(_TokenizerEngine):
    def __init__(self, tokenizer_path, completion: str, completion_tokens: int, chat: str = "fast", max_inflight: int = 256):
        super().__init__(tokenizer_path, chat, max_inflight)
        self.completion, self.completion_tokens = completion, completion_tokens
        self.first_request_cpu: float | None = None  # process CPU time at the first request (per-shard fixed costs end there)

    async def generate_one(self, request: Request) -> Completion:
        if self.first_request_cpu is None:
            self.first_request_cpu = time.process_time()
        # Suspend once, as a real engine does (its answer arrives later, from its own thread
        # or process): the event loop's per-row cost is part of what is measured.
        await asyncio.sleep(0)
        return Completion(request.id, self.completion, len(request.prompt or "") // 4, self.completion_tokens, "stop")


class SimulatedBatchEngine(_TokenizerEngine):
    """Continuous batching: up to ``capacity`` sequences run; each step of ``step_seconds``
    gives every running sequence one token; waiting requests join at the next step.

    ``lengths[request.id]`` is the number of tokens a request generates. The step clock is
    deadline-based (step k ends at t0 + k * step_seconds while the engine is busy), so event
    loop jitter does not add up; when nothing is running the engine idles and the clock
    restarts with the next request. Counters: ``steps``, ``tokens``, ``busy_seconds``.
    """

    def __init__(
        self,
        lengths: dict[int, int],
        capacity: int = 256,
        step_seconds: float = 0.002,
        tokenizer_path=None,
        chat: str = "none",
        max_inflight: int | None = None,
    ):
        super().__init__(tokenizer_path, chat, max_inflight or 2 * capacity)
        self.lengths, self.capacity, self.step_seconds = lengths, capacity, step_seconds
        self.steps = self.tokens = 0
        self.occupancy_sum = 0  # sum over steps of running sequences
        self.steps_fed = self.tokens_fed = 0  # at the last step that admitted a request
        self._waiting: deque = deque()  # FIFO of (request, future)
        self._running: list = []  # heap of (finish_step, seq, request, future)
        self._seq = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def generate_one(self, request: Request) -> Completion:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._scheduler())
        future = loop.create_future()
        self._waiting.append((request, future))
        self._wake.set()
        return await future

    def queue_depth(self) -> int:
        return len(self._waiting) + len(self._running)

    async def _scheduler(self) -> None:
        waiting, running = self._waiting, self._running
        deadline = None
        while True:
            if not waiting and not running:
                self._wake.clear()
                await self._wake.wait()
                deadline = None
            # admit at the step boundary
            if waiting and len(running) < self.capacity:  # feeding: steps so far, before the drain
                self.steps_fed, self.tokens_fed = self.steps, self.tokens
            while waiting and len(running) < self.capacity:
                req, fut = waiting.popleft()
                n = self.lengths[req.id]
                self._seq += 1
                heapq.heappush(running, (self.steps + n, self._seq, req, fut, n))
            # one decode step for everything running
            now = time.monotonic()
            deadline = (now if deadline is None else deadline) + self.step_seconds
            delay = deadline - now
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # behind schedule: catch up, but let the feeder run
            self.steps += 1
            self.occupancy_sum += len(running)
            self.tokens += len(running)
            while running and running[0][0] <= self.steps:
                _, _, req, fut, n = heapq.heappop(running)
                if not fut.done():
                    fut.set_result(Completion(req.id, "x", len(req.prompt or "") // 4, n, "length"))


class SlowEngine(_TokenizerEngine):
    """Answers after ``delay`` seconds (uniform in the given range); logs finished ids."""

    def __init__(
        self,
        delay=(0.002, 0.008),
        log_path: str | None = None,
        seed: int = 0,
        max_inflight: int = 64,
        tokenizer_path=None,
        chat: str = "none",
    ):
        super().__init__(tokenizer_path, chat, max_inflight)
        self.delay, self.log_path = delay, log_path
        self.rng = random.Random(seed)
        self._fd = None
        self.computed: list[int] = []

    def load(self) -> None:
        super().load()
        if self.log_path:
            self._fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    async def generate_one(self, request: Request) -> Completion:
        await asyncio.sleep(self.rng.uniform(*self.delay))
        self.computed.append(request.id)
        if self._fd is not None:
            os.write(self._fd, f"{request.id}\n".encode())
        return Completion(request.id, f"answer {request.id}", len(request.prompt or "") // 4, 3, "stop")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
