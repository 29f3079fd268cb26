"""Steps of the row path that are not an LLM call: filters and Python (custom) functions.

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
``name``. It runs in a pool of ``max_workers`` processes (pebble; ``start_method`` spawn by
default), so the event loop that feeds the engine never waits on user code and a crash
(``os._exit``, a segfault) kills one worker, which is replaced. Row errors, each with its
class: ``custom_error`` (the function raised; its type and message), ``custom_timeout`` (a
call ran past ``timeout_ms``: an alarm (SIGALRM) interrupts it and the worker goes on; code
that does not return to Python is stopped by killing its worker), ``custom_crashed`` (the
worker process died; it is replaced), ``custom_bad_value`` (the value is not JSON: a set,
an object, NaN). Rows go to the workers in batches (``FunctionPool``), so the pool's cost
per message is shared by the rows that arrived while every worker was busy.

MMIRAGE's ``fallback_value``, ``max_errors`` and ``max_timeouts`` are accepted, so its
files load, but they do not hide failures here: a failed call is always a row error in
errors.jsonl (never an invented value in the records), and ``shard_params.max_errors`` /
``max_error_rate`` decide when the shard fails, counting these rows with every other row
error. A set ``fallback_value`` is named in a WARNING in the shard's log.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import signal

import jinja2
from jinja2.runtime import new_context as _new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mirageflow.config.types import CustomProcessor, OutputVar
from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.prompts.templates import template_problems

log = logging.getLogger(__name__)

# The prompts' sandbox settings: same built-ins, same refusals, StrictUndefined.
_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
_BRACED = re.compile(r"^\s*\{\{(.*)\}\}\s*$", re.S)

class _Filtered:
    def __repr__(self) -> str:
        return "FILTERED"


# What the row path returns for a row a filter dropped (no record, no error).
FILTERED = _Filtered()
# Seconds the pool may take to start its workers and import the script once at load.
POOL_START_TIMEOUT = 300.0


def predicate_expression(predicate: str) -> str:
    """The expression of a predicate; ``{{ score > 33 }}`` is accepted for ``score > 33``."""
    m = _BRACED.match(predicate)
    return m.group(1) if m else predicate


def predicate_problems(predicate: str, known, where: str, json_fields=None) -> list[str]:
    """Syntax errors, unknown variables, undeclared JSON fields of a predicate (as a prompt's)."""
    expr = predicate_expression(predicate)
    if not expr.strip():
        return [f"{where}: empty predicate (a Jinja2 expression such as 'score > 33')"]
    return template_problems("{{ (" + expr + ") }}", known, where, json_fields)


def load_function(script_path: str, function_name: str):
    """Import the script (as a module of its own, not in sys.modules) and return the function."""
    name = "mirageflow_custom_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(script_path))[0])
    spec = importlib.util.spec_from_file_location(name, script_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"'{script_path}' cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, function_name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"'{script_path}' defines no '{function_name}' (callables found: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise TypeError(f"'{function_name}' in '{script_path}' is a {type(fn).__name__}, not a function")
    return fn


# --------------------------------------------------------------------------- worker side

_FN = None
_LOAD_ERROR: str | None = None


class _CallTimeout(BaseException):
    """Raised in the worker by the timeout_ms alarm; not an Exception, so that the function's
    own ``except Exception`` does not swallow it."""


def _alarm(signum, frame):
    raise _CallTimeout()


def _init_worker(script_path: str, function_name: str) -> None:
    """Each worker imports the script once (also a worker restarted after a timeout or crash)."""
    global _FN, _LOAD_ERROR
    try:
        _FN = load_function(script_path, function_name)
    except BaseException as e:  # reported by _loaded() at pool start, and by every call
        _LOAD_ERROR = f"cannot load '{function_name}' from '{script_path}': {type(e).__name__}: {e}"


def _loaded() -> str | None:
    return _LOAD_ERROR


def _call_many(batch: list[dict], timeout: float | None) -> list[tuple]:
    """One outcome per row: ("ok", JSON text) | ("raised", message) | ("bad_value", message) |
    ("timeout", ""). The user's exceptions are data here, so that a TimeoutError it raises is
    not taken for the pool's own. timeout_ms is an alarm per call (the worker lives on); code
    that ignores signals is stopped by the parent's backstop instead."""
    if timeout:
        signal.signal(signal.SIGALRM, _alarm)
    return [_call(variables, timeout) for variables in batch]


def _call(variables: dict, timeout: float | None) -> tuple:
    if _LOAD_ERROR is not None:
        return ("raised", _LOAD_ERROR)
    try:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            value = _FN(variables)
        finally:
            if timeout:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _CallTimeout:
        return ("timeout", "")
    except Exception as e:
        return ("raised", f"{type(e).__name__}: {e}")
    try:
        # the value crosses as JSON text: what the parent gets is what the writer can write
        return ("ok", json.dumps(value, allow_nan=False, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        return ("bad_value", f"returned a value that is not JSON ({type(value).__name__}: {e})")


# --------------------------------------------------------------------------- parent side

# Exit codes of a worker stopped by SIGTERM/SIGHUP (a job being cancelled): the shard stops, no row
# error. pebble's workers exit with the signal's number on SIGTERM.
_STOP_CODES = (signal.SIGTERM, -signal.SIGTERM, -signal.SIGHUP)
# Rows per message to a worker. A message costs ~0.2-1 ms of the pool's threads, pickling
# and pipes (2-core machine): rows that wait while every worker is busy go together.
MAX_BATCH = 64
# Seconds past timeout_ms x rows before a batch is stopped by killing its worker (code the
# alarm cannot interrupt); its rows are then retried one per message.
BACKSTOP_SLACK = 5.0


class FunctionPool:
    """The worker processes of one custom processor; ``call`` is awaited on the event loop.

    Rows are sent in batches: up to 2 x max_workers messages in flight, and the rows that
    arrive meanwhile wait and go together in the next one (up to MAX_BATCH), so the pool's
    per-message cost is shared when rows come fast and nothing waits when they trickle. A
    batch whose worker died (or that hit the backstop) is rerun one row per message, to
    find the row that did it: the others' function may then run twice.
    """

    def __init__(self, proc: CustomProcessor):
        self.proc = proc
        self.script_path = os.path.abspath(os.path.expanduser(proc.script_path))
        self.timeout = proc.timeout_ms / 1000.0 if proc.timeout_ms else None
        self._pool = None
        self._waiting: list[tuple[dict, asyncio.Future]] = []
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        """Start the workers and import the script in each; a script that does not load fails here, once."""
        import multiprocessing

        import pebble  # imported by shards with a custom processor only

        p = self.proc
        if p.fallback_value is not None:
            log.warning(
                "processor '%s': fallback_value is not used: a failed call is a row error (errors.jsonl), never an "
                "invented value in the records; return your fallback from %s itself to keep such rows", p.type, p.function_name,
            )  # fmt: skip
        self._pool = pebble.ProcessPool(
            p.max_workers, context=multiprocessing.get_context(p.start_method),
            initializer=_init_worker, initargs=(self.script_path, p.function_name),
        )  # fmt: skip
        for future in [self._pool.schedule(_loaded) for _ in range(p.max_workers)]:
            try:
                error = future.result(timeout=POOL_START_TIMEOUT)
            except Exception as e:  # the workers died before answering (start_method spawn re-imports __main__)
                raise RuntimeError(
                    f"processor '{p.type}': its worker processes (start_method {p.start_method}) did not start: "
                    f"{type(e).__name__}: {e}; the log above has the workers' traceback"
                ) from e
            if error:
                raise RuntimeError(f"processor '{p.type}': {error}")

    async def call(self, variables: dict, where: str):
        """The function's value for this row; RowError when it raised, timed out, crashed or returned no JSON."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((variables, future))
        self._send()
        status, payload = await future
        if status == "ok":
            return json.loads(payload)
        if status == "stopped":  # not this row's fault: the shard stops (a rerun redoes the row)
            from mirageflow.shard.failures import ShardFailed

            raise ShardFailed(f"{where}: a worker process of processor '{self.proc.type}' was stopped by {payload}")
        kind, message = {
            "raised": (E.CUSTOM_ERROR, payload),
            "bad_value": (E.CUSTOM_BAD_VALUE, payload),
            "timeout": (E.CUSTOM_TIMEOUT, f"the call ran past timeout_ms ({self.proc.timeout_ms} ms)"),
            "killed": (E.CUSTOM_TIMEOUT, f"the call ran past timeout_ms ({self.proc.timeout_ms} ms) and ignored the alarm: its worker was killed"),
            "crashed": (E.CUSTOM_CRASHED, f"the worker process died ({payload}) during the call"),
            "unsent": (E.CUSTOM_ERROR, f"the call could not be made: {payload}"),
        }[status]  # fmt: skip
        raise RowError("custom", kind, f"{where}: {message}")

    def _send(self) -> None:
        """Hand waiting rows to free message slots (on the event loop)."""
        slots = 2 * self.proc.max_workers - self._in_flight
        while self._waiting and slots > 0:
            size = min(MAX_BATCH, -(-len(self._waiting) // slots))
            batch, self._waiting = self._waiting[:size], self._waiting[size:]
            slots -= 1
            self._in_flight += 1
            task = asyncio.ensure_future(self._run_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: list[tuple[dict, asyncio.Future]]) -> None:
        more = True  # send waiting rows when done (not when the loop is being shut down)
        try:
            outcomes = await self._outcomes([v for v, _ in batch])
            if len(outcomes) > 1 and any(o[0] in ("crashed", "killed", "unsent") for o in outcomes):
                outcomes = await asyncio.gather(*(self._outcomes([v]) for v, _ in batch))  # find the row
                outcomes = [o[0] for o in outcomes]
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
            self._in_flight -= 1
            if more and self._waiting:
                self._send()

    async def _outcomes(self, rows: list[dict]) -> list[tuple]:
        """The outcome of each row of one message; the whole message's when it failed as a whole."""
        from pebble import ProcessExpired

        backstop = None if self.timeout is None else self.timeout * len(rows) + BACKSTOP_SLACK
        try:
            return await asyncio.wrap_future(self._pool.schedule(_call_many, args=(rows, self.timeout), timeout=backstop))
        except TimeoutError:  # the alarm did not stop it: the worker was killed
            return [("killed", "")] * len(rows)
        except ProcessExpired as e:
            if e.exitcode in _STOP_CODES:  # stopped, not crashed: the job is being stopped
                return [("stopped", f"signal {signal.Signals(abs(e.exitcode)).name}")] * len(rows)
            return [("crashed", f"exit code {e.exitcode}")] * len(rows)
        except Exception as e:  # the variables could not be sent (pickling)
            return [("unsent", f"{type(e).__name__}: {e}")] * len(rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()  # every row is finished or abandoned by now
            self._pool.join(timeout=10)
            self._pool = None


# --------------------------------------------------------------------------- steps


class FilterStep:
    """``outputs[]`` of type filter: ``run`` says whether the row goes on."""

    engine = None  # not an LLM step (ShardRunner._row)
    wants_unit = False  # run(variables) (image steps get the row's place too: prompts/image_outputs.py)

    def __init__(self, output: OutputVar):
        self.output = output
        self.where = f"filter '{output.name}'" if output.name else "filter"
        self.predicate = predicate_expression(output.predicate).strip()
        # compile_expression's template, run on a shared context over one merged dict: what
        # TemplateExpression.__call__ does with a copy of the variables (4 us a row instead of 19)
        template = _ENV.compile_expression(self.predicate, undefined_to_none=False)._template
        self._env, self._name, self._blocks = template.environment, template.name, template.blocks
        self._root, self._globals = template.root_render_func, dict(template.globals)

    async def run(self, variables: dict) -> bool:
        return self.keep(variables)

    def keep(self, variables: dict) -> bool:
        try:
            ctx = _new_context(self._env, self._name, self._blocks, {**self._globals, **variables}, True, None)
            for _ in self._root(ctx):
                pass
            value = ctx.vars["result"]
        except Exception as e:
            raise RowError("filter", E.FILTER_ERROR, f"{self.where}: predicate '{self.predicate}' raised {type(e).__name__}: {e}") from None
        if value is True or value is False:
            return value
        shown = "an undefined value" if isinstance(value, jinja2.Undefined) else f"{type(value).__name__} {value!r}"[:200]
        raise RowError("filter", E.FILTER_NOT_BOOL,
            f"{self.where}: predicate '{self.predicate}' gave {shown}, not true or false; write a comparison "
            "(e.g. verdict == 'yes', score > 33, text | length > 0)",
        )  # fmt: skip


class CustomStep:
    """``outputs[]`` of type custom: the processor's function sets the variable ``name``."""

    engine = None  # not an LLM step (ShardRunner._row)
    wants_unit = False

    def __init__(self, output: OutputVar, pool: FunctionPool):
        self.output, self.pool = output, pool
        self.where = f"output '{output.name}': {pool.proc.function_name}() of {pool.proc.script_path}"

    async def run(self, variables: dict) -> bool:
        variables[self.output.name] = await self.pool.call(variables, self.where)
        return True


def start_pools(processors: dict[str, CustomProcessor], outputs) -> dict[str, FunctionPool]:
    """A started pool per custom processor that an output uses."""
    pools: dict[str, FunctionPool] = {}
    try:
        for name in dict.fromkeys(o.processor for o in outputs if o.kind == "custom"):
            pools[name] = pool = FunctionPool(processors[name])
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


__all__ = [
    "FILTERED", "CustomProcessor", "CustomStep", "FilterStep", "FunctionPool", "close_pools", "load_function", "make_step",
    "predicate_expression", "predicate_problems", "start_pools",
]  # fmt: skip
