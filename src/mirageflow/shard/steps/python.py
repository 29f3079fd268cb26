"""Steps of the row path that are not an LLM call: filters and Python (custom) functions
(each a ``base.Step`` the row path awaits ``run`` of).

**Filter** (``outputs[]: {type: filter, predicate: score > 33}``, MMIRAGE's form): a Jinja2
expression over the variables so far, evaluated in the same sandbox as the prompts. True:
the row goes on; false: the row stops there, is written nowhere and is counted as
filtered (``rows_filtered``), never as an error. Anything but a boolean is the row error
``filter_not_bool``: a predicate such as ``verdict`` where the model answered the string
"false" would otherwise keep the row (a non-empty string is truthy); write a comparison
(``verdict == 'yes'``, ``score > 33``, ``text | length > 0``). A predicate that raises (a
missing JSON field, ``'a' > 3``) is the row error ``filter_error``.

**Custom** (``processors[]: {type: custom, script_path, function_name, ...}`` and
``outputs[]: {name, type: custom}``): the function is called once per row with one
argument, a dict of the variables so far (inputs and earlier outputs), and its return
value (JSON-able: str, number, bool, None, lists and dicts of these) becomes the variable
``name``. It runs in ``max_workers`` worker processes, each with a pipe of its own
(mirageflow.prompts.user_code; ``start_method`` spawn by default), so the event loop that
feeds the engine never waits on user code, and whatever the function does can only fail
its row: an exception of any kind (``sys.exit``, ``KeyboardInterrupt`` included), a value
that is not JSON or holds a lone surrogate, a worker that exits (``os._exit``), crashes,
signals itself or is killed (the OOM killer; every worker at once) is a row error, the
worker is replaced and the rows it held are retried once, alone, before they fail. Row
errors, each with its class: ``custom_error`` (the function raised; its type and message),
``custom_timeout`` (a call ran past ``timeout_ms``: an alarm (SIGALRM) interrupts it and
the worker goes on; code that does not return to Python is stopped by killing its
worker), ``custom_crashed`` (the worker process died, and died again on the retry),
``custom_bad_value`` (the value is not JSON: a set, an object, NaN, a lone surrogate).
Only a stop signal the shard itself received (scancel, Ctrl-C, a time limit) stops the
shard instead. Rows go to the workers in batches (``FunctionPool``), so the cost per
message is shared by the rows that arrived while every worker was busy.

MMIRAGE's ``fallback_value``, ``max_errors`` and ``max_timeouts`` are accepted, so its
files load, but they do not hide failures here: a failed call is always a row error in
errors.jsonl (never an invented value in the records), and ``shard_params.max_errors`` /
``max_error_rate`` decide when the shard fails, counting these rows with every other row
error. A set ``fallback_value`` is named in a WARNING in the shard's log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import jinja2
from jinja2.runtime import new_context as _new_context

from mirageflow.config.types import CustomProcessor, OutputVar
from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.prompts.render_bounds import BoundedSandbox, RenderTimeout, RenderTooLarge, guarded, limit_message
from mirageflow.prompts.templates import predicate_expression
from mirageflow.shard.failures import ShardFailed
from mirageflow.shard.steps.base import Step, Unit

log = logging.getLogger(__name__)

# The prompts' sandbox settings: same built-ins, same refusals, StrictUndefined, same limits.
_ENV = BoundedSandbox(undefined=jinja2.StrictUndefined, autoescape=False)


# --------------------------------------------------------------------------- parent side

# Exit codes of a worker stopped by a signal that also stops jobs (SIGTERM: scancel, a time
# limit; SIGHUP; SIGINT): the shard is being stopped when it received one too.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# Seconds a shard waits, after a worker died of such a signal, for its own to arrive (scancel
# signals every process of the job at about the same time) before calling it the row's.
STOP_GRACE_SECONDS = 1.0
# Rows per message to a worker. A message costs ~0.2-1 ms of pickling, pipes and a thread
# switch (2-core machine): rows that wait while every worker is busy go together.
MAX_BATCH = 64
# Seconds past timeout_ms x rows before a batch is stopped by killing its worker (code the
# alarm cannot interrupt); its rows are then retried one per message.
BACKSTOP_SLACK = 5.0


class FunctionPool:
    """The worker processes of one custom processor (mirageflow.prompts.user_code); ``call``
    is awaited on the event loop.

    Rows are sent in batches: one batch per worker at a time, and the rows that arrive
    meanwhile wait and go together in the next one (up to MAX_BATCH), so the per-message
    cost is shared when rows come fast and nothing waits when they trickle. When a worker
    dies (it exited, was killed, signalled itself, ran past the backstop) its batch is
    retried once, one row per message, on the replaced worker: the row that did it fails
    alone (``custom_crashed`` / ``custom_timeout``), the others' function may run twice.
    Killing every worker at once is the same, per worker. A worker stopped by SIGTERM/
    SIGHUP/SIGINT while the shard itself is being stopped (``stopping()`` true) stops the
    shard instead: the job is being cancelled, a rerun redoes the rows.
    """

    def __init__(self, proc: CustomProcessor, stopping=None):
        self.proc = proc
        self.script_path = os.path.abspath(os.path.expanduser(proc.script_path))
        self.timeout = proc.timeout_ms / 1000.0 if proc.timeout_ms else None
        self.stopping = stopping or (lambda: False)  # whether the shard received a stop signal
        self._workers: list = []
        self._idle: list = []
        self._waiting: list[tuple[dict, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        self._threads = None

    def start(self) -> None:
        """Start the workers and import the script in each; a script that does not load fails here, once."""
        from concurrent.futures import ThreadPoolExecutor

        from mirageflow.prompts import user_code

        p = self.proc
        if p.fallback_value is not None:
            log.warning(
                "processor '%s': fallback_value is not used: a failed call is a row error (errors.jsonl), never an "
                "invented value in the records; return your fallback from %s itself to keep such rows", p.type, p.function_name,
            )  # fmt: skip
        self._workers = user_code.start_workers(self.script_path, p.function_name, p.max_workers, p.start_method, p.type)
        self._idle = list(self._workers)
        self._threads = ThreadPoolExecutor(max_workers=p.max_workers, thread_name_prefix=f"custom-{p.type}")

    async def call(self, variables: dict, where: str):
        """The function's value for this row; RowError when it raised, timed out, crashed or returned no JSON."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((variables, future))
        self._send()
        status, payload = await future
        if status == "ok":
            return json.loads(payload)
        if status == "stopped":  # not this row's fault: the shard stops (a rerun redoes the row)
            raise ShardFailed(f"{where}: a worker process of processor '{self.proc.type}' was stopped by {payload}")
        kind, message = {
            "raised": (E.CUSTOM_ERROR, payload),
            "bad_value": (E.CUSTOM_BAD_VALUE, payload),
            "timeout": (E.CUSTOM_TIMEOUT, f"the call ran past timeout_ms ({self.proc.timeout_ms} ms)"),
            "killed": (E.CUSTOM_TIMEOUT, f"the call ran past timeout_ms ({self.proc.timeout_ms} ms) and ignored the alarm: its worker was killed"),
            "crashed": (E.CUSTOM_CRASHED, f"the worker process died ({payload}) during the call, and again when the row was retried alone on a new worker"),
            "unsent": (E.CUSTOM_ERROR, f"the call could not be made: {payload}"),
        }[status]  # fmt: skip
        raise RowError("custom", kind, f"{where}: {message}")

    def _send(self) -> None:
        """Hand waiting rows to idle workers (on the event loop)."""
        while self._waiting and self._idle:
            size = min(MAX_BATCH, -(-len(self._waiting) // len(self._idle)))
            batch, self._waiting = self._waiting[:size], self._waiting[size:]
            worker = self._idle.pop()
            task = asyncio.ensure_future(self._run_batch(worker, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, worker, batch: list[tuple[dict, asyncio.Future]]) -> None:
        more = True  # send waiting rows when done (not when the loop is being shut down)
        try:
            rows = [v for v, _ in batch]
            outcomes = await self._outcomes(worker, rows)
            if any(o[0] in ("crashed", "killed", "unsent") for o in outcomes) and (len(rows) > 1 or outcomes[0][0] == "crashed"):
                # retried once, each row alone on this (replaced) worker: the row that did it
                # fails alone; a row whose worker was killed by something else gets a second chance
                outcomes = [(await self._outcomes(worker, [v]))[0] for v in rows]
            if any(o[0] in ("crashed", "killed") for o in outcomes) and self.stopping():  # the job is being stopped meanwhile
                outcomes = [("stopped", "a stop signal") if o[0] in ("crashed", "killed") else o for o in outcomes]
            for (_, future), outcome in zip(batch, outcomes):
                if not future.done():  # a row cancelled meanwhile (the shard stops) is not waiting
                    future.set_result(outcome)
        except BaseException as e:  # never leave a row waiting forever
            for _, future in batch:
                if not future.done():
                    future.set_exception(e if isinstance(e, Exception) else RuntimeError(f"worker pool stopped: {e!r}"))
            if not isinstance(e, Exception):
                more = False
                raise
        finally:
            self._idle.append(worker)
            if more and self._waiting:
                self._send()

    async def _outcomes(self, worker, rows: list[dict]) -> list[tuple]:
        """The outcome of each row of one message; the whole message's when its worker died."""
        from mirageflow.prompts.user_code import WorkerDied

        backstop = None if self.timeout is None else self.timeout * len(rows) + BACKSTOP_SLACK
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            try:
                return await loop.run_in_executor(self._threads, worker.run, rows, self.timeout, backstop)
            except WorkerDied as e:
                if not e.started and attempt == 0:  # it died between batches: these rows never ran
                    continue
                if e.killed:
                    return [("killed", "")] * len(rows)
                if e.exitcode is not None and -e.exitcode in _STOP_SIGNALS and await self._stopping():
                    return [("stopped", f"signal {signal.Signals(-e.exitcode).name}")] * len(rows)
                return [("crashed", str(e))] * len(rows)
            except Exception as e:  # the variables could not be sent (pickling)
                return [("unsent", f"{type(e).__name__}: {e}")] * len(rows)
        return [("crashed", "it died before it could take the rows, twice")] * len(rows)

    async def _stopping(self) -> bool:
        """Whether the shard is being stopped; waits STOP_GRACE_SECONDS for its signal to arrive."""
        for _ in range(int(STOP_GRACE_SECONDS / 0.05)):
            if self.stopping():
                return True
            await asyncio.sleep(0.05)
        return self.stopping()

    def close(self) -> None:
        for worker in self._workers:  # every row is finished or abandoned by now
            worker.stop()
        self._workers, self._idle = [], []
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None


# --------------------------------------------------------------------------- steps


class FilterStep(Step):
    """``outputs[]`` of type filter: ``run`` says whether the row goes on."""

    once_per_row = True  # the same for every sample of a row when it reads only what they share

    def __init__(self, output: OutputVar):
        self.output = output
        self.where = f"filter '{output.name}'" if output.name else "filter"
        self.predicate = predicate_expression(output.predicate).strip()
        # compile_expression's template, run on a shared context over one merged dict: what
        # TemplateExpression.__call__ does with a copy of the variables (4 us a row instead of 19)
        template = _ENV.compile_expression(self.predicate, undefined_to_none=False)._template
        self._env, self._name, self._blocks = template.environment, template.name, template.blocks
        self._root, self._globals = template.root_render_func, dict(template.globals)

    async def run(self, variables: dict, unit: Unit) -> bool:
        return self.keep(variables)

    def _evaluate(self, variables: dict):
        ctx = _new_context(self._env, self._name, self._blocks, {**self._globals, **variables}, True, None)
        for _ in self._root(ctx):
            pass
        return ctx.vars["result"]

    def keep(self, variables: dict) -> bool:
        try:
            value = guarded(self._evaluate, variables)
        except (RenderTimeout, RenderTooLarge) as e:
            kind, message = limit_message(e)
            raise RowError("filter", kind, f"{self.where}: predicate '{self.predicate}': {message}") from None
        except Exception as e:
            raise RowError("filter", E.FILTER_ERROR, f"{self.where}: predicate '{self.predicate}' raised {type(e).__name__}: {e}") from None
        if value is True or value is False:
            return value
        shown = "an undefined value" if isinstance(value, jinja2.Undefined) else f"{type(value).__name__} {value!r}"[:200]
        raise RowError("filter", E.FILTER_NOT_BOOL,
            f"{self.where}: predicate '{self.predicate}' gave {shown}, not true or false; write a comparison "
            "(e.g. verdict == 'yes', score > 33, text | length > 0)",
        )  # fmt: skip


class CustomStep(Step):
    """``outputs[]`` of type custom: the processor's function sets the variable ``name``."""

    def __init__(self, output: OutputVar, pool: FunctionPool):
        self.output, self.pool = output, pool
        self.where = f"output '{output.name}': {pool.proc.function_name}() of {pool.proc.script_path}"

    async def run(self, variables: dict, unit: Unit) -> bool:
        variables[self.output.name] = await self.pool.call(variables, self.where)
        return True


def start_pools(processors: dict[str, CustomProcessor], outputs, stopping=None) -> dict[str, FunctionPool]:
    """A started pool per custom processor that an output uses. ``stopping()``: whether the
    shard received a stop signal (tells a cancelled job from a worker that signalled itself)."""
    pools: dict[str, FunctionPool] = {}
    try:
        for name in dict.fromkeys(o.processor for o in outputs if o.kind == "custom"):
            pools[name] = pool = FunctionPool(processors[name], stopping)
            pool.start()
    except BaseException:
        close_pools(pools)
        raise
    return pools


def close_pools(pools: dict[str, FunctionPool]) -> None:
    for pool in pools.values():
        try:
            pool.close()
        except Exception:  # closing must not hide the shard's own error
            log.exception("closing the worker pool of processor '%s' failed", pool.proc.type)


def make_step(output: OutputVar, steps_for_llm, pools: dict[str, FunctionPool]):
    """The step of one output: a FilterStep, a CustomStep, or ``steps_for_llm(output)``."""
    if output.kind == "filter":
        return FilterStep(output)
    if output.kind == "custom":
        return CustomStep(output, pools[output.processor])
    return steps_for_llm(output)
