"""The boundary around user code (custom steps): worker processes that can only fail their rows.

Each worker is a process with a pipe of its own (``multiprocessing``, ``start_method`` spawn
by default), driven by one thread of the parent: the thread sends a batch of rows, waits
for the answer or the worker's death, and hands the outcome to the event loop. Nothing is
shared between workers (no common queue or lock a dying worker could leave held), so a
worker that exits, is killed (SIGKILL, the kernel's OOM killer), signals itself or stops
answering takes down only the batch it holds, and is replaced by a fresh process before
its next batch. What the user's function does inside a call is caught in the worker
(``call_many``): any BaseException (SystemExit, KeyboardInterrupt, ...) is an outcome, a
value is sent back as JSON text after it is checked (no NaN, no lone surrogate, at most
``MAX_VALUE_CHARS``).

Outcomes, one per row: ("ok", JSON text) | ("raised", message) | ("bad_value", message) |
("timeout", "") from the worker; ("crashed", how) | ("killed", "") | ("unsent", message)
from the parent when the worker died, was killed past its deadline, or the rows could not
be sent. ``mirageflow.shard.steps.python.FunctionPool`` turns them into row errors.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import re
import signal
import threading
from multiprocessing.connection import wait as wait_for
from typing import Any

from mirageflow.errors import MirageflowError

log = logging.getLogger(__name__)

MAX_VALUE_CHARS = 64 << 20  # a function's value, as JSON text
START_TIMEOUT_SECONDS = 300.0  # a worker's start and the script's import
STOP_TIMEOUT_SECONDS = 5.0
_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text: str, limit: int = 2000) -> str:
    """``text`` safe to write anywhere: lone surrogates as ``\\udXXX`` escapes, at most ``limit`` characters."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(e: BaseException) -> str:
    """``Type: message`` of an exception raised by user code (whose ``__str__`` may itself raise)."""
    try:
        message = str(e)
    except BaseException:  # noqa: BLE001 - a broken __str__ is the user's
        message = "<its message cannot be shown>"
    name = type(e).__name__
    if isinstance(e, SystemExit):
        return f"SystemExit: the function called sys.exit({message})"
    return printable(f"{name}: {message}" if message else name)


def exit_description(exitcode: int | None) -> str:
    """How a worker process ended, for messages."""
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (the kernel's OOM killer sends it when memory runs out)" if -exitcode == signal.SIGKILL else ""
        return f"killed by {name}{why}"
    return f"exit code {exitcode}"


# --------------------------------------------------------------------------- worker side

_FN = None
_LOAD_ERROR: str | None = None
_LOAD_KIND: str | None = None  # "function": the script loads but has no such function; "script": it does not load
_LOAD_DETAIL = [""]  # the message alone, for the driver's preflight


class _CallTimeout(BaseException):
    """Raised in the worker by the timeout alarm; not an Exception, so that the function's
    own ``except Exception`` does not swallow it."""


class FunctionMissing(MirageflowError, AttributeError):
    """The script loads, but does not define the function (or it is not callable)."""


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
        raise FunctionMissing(f"'{script_path}' defines no '{function_name}' (callables found: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise FunctionMissing(f"'{function_name}' in '{script_path}' is a {type(fn).__name__}, not a function")
    return fn


def _alarm(signum, frame):
    raise _CallTimeout()


def _load(script_path: str, function_name: str) -> None:
    global _FN, _LOAD_ERROR, _LOAD_KIND
    try:
        _FN = load_function(script_path, function_name)
    except FunctionMissing as e:
        _LOAD_ERROR, _LOAD_KIND = f"cannot load '{function_name}' from '{script_path}': {describe(e)}", "function"
        _LOAD_DETAIL[0] = str(e)
    except BaseException as e:  # noqa: BLE001 - the user's script: anything, SystemExit included
        _LOAD_ERROR, _LOAD_KIND = f"cannot load '{function_name}' from '{script_path}': {describe(e)}", "script"
        _LOAD_DETAIL[0] = describe(e)


def call_many(batch: list[dict], timeout: float | None) -> list[tuple]:
    """One outcome per row; timeout: an alarm per call (the worker lives on)."""
    if timeout:
        signal.signal(signal.SIGALRM, _alarm)
    return [_call(variables, timeout) for variables in batch]


def _call(variables: dict, timeout: float | None) -> tuple:
    if _LOAD_ERROR is not None:
        return ("raised", _LOAD_ERROR)
    try:
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
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...: the row's error
            return ("raised", describe(e))
        return _encoded(value)
    except _CallTimeout:  # the alarm landed between the call's end and the timer's reset
        return ("timeout", "")


def _encoded(value: Any) -> tuple:
    """The value as JSON text, or why it cannot be a record's value."""
    try:
        # the value crosses as JSON text: what the parent gets is what the writer can write
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except BaseException as e:  # noqa: BLE001 - TypeError, ValueError, RecursionError, a broken __str__
        return ("bad_value", f"returned a value that is not JSON ({type(value).__name__}: {describe(e)})")
    if len(text) > MAX_VALUE_CHARS:
        return ("bad_value", f"returned a value of {len(text)} characters as JSON, more than {MAX_VALUE_CHARS}")
    if _SURROGATE.search(text):
        return ("bad_value", "returned text holding a lone surrogate (\\ud800-\\udfff: invalid Unicode, no file or engine can take it)")
    return ("ok", text)


def worker_main(conn, script_path: str, function_name: str) -> None:
    """A worker process: import the script, then answer batches until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the shard, which stops the workers itself
    _load(script_path, function_name)
    try:
        conn.send(("ready", _LOAD_ERROR, _LOAD_KIND, _LOAD_DETAIL[0]))
        while True:
            message = conn.recv()
            if message is None:
                return
            rows, timeout = message
            conn.send(call_many(rows, timeout))
    except (EOFError, OSError, KeyboardInterrupt):  # the parent went away
        return


# --------------------------------------------------------------------------- parent side


class WorkerDied(MirageflowError):
    """The worker holding a batch ended (or was killed past its deadline) before answering."""

    def __init__(self, exitcode: int | None, killed: bool = False, started: bool = True):
        self.exitcode, self.killed, self.started = exitcode, killed, started
        super().__init__(exit_description(exitcode))


class Worker:
    """One worker process and its pipe; ``run`` is called from one thread at a time."""

    def __init__(self, context, script_path: str, function_name: str, name: str):
        self.context, self.script_path, self.function_name, self.name = context, script_path, function_name, name
        self.process = None
        self.conn = None
        self.lock = threading.Lock()

    def start(self) -> None:
        parent, child = self.context.Pipe(duplex=True)
        process = self.context.Process(
            target=worker_main, args=(child, self.script_path, self.function_name), name=self.name, daemon=True
        )  # fmt: skip
        process.start()
        child.close()  # only the worker holds its end: its death is an EOF here
        self.process, self.conn = process, parent

    def ready(self, timeout: float = START_TIMEOUT_SECONDS) -> str | None:
        """Wait for the started worker's hello: its script's load error, or None."""
        answer = self._receive(timeout)
        return answer[1]

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def restart(self) -> None:
        self.stop()
        self.start()
        error = self.ready()
        if error:  # the script no longer loads (edited meanwhile): every row says so
            log.warning("%s: %s", self.name, error)

    def run(self, rows: list[dict], timeout: float | None, deadline: float | None) -> list[tuple]:
        """Send ``rows``, wait for their outcomes; WorkerDied when the worker ends first (or
        runs past ``deadline`` seconds: it is killed)."""
        if not self.alive():
            self.restart()
        try:
            self.conn.send((rows, timeout))
        except (BrokenPipeError, ConnectionResetError, EOFError):  # it died between batches
            raise WorkerDied(self._reap(), started=False) from None
        return self._receive(deadline)

    def _receive(self, deadline: float | None):
        ready = wait_for([self.conn, self.process.sentinel], deadline)
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                pass
        elif not ready:  # past the deadline: its code ignores the alarm (or it is frozen)
            self.kill()
            raise WorkerDied(self.process.exitcode, killed=True)
        raise WorkerDied(self._reap())

    def _reap(self) -> int | None:
        self.process.join(STOP_TIMEOUT_SECONDS)
        if self.process.is_alive():
            self.kill()
        return self.process.exitcode

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.join(STOP_TIMEOUT_SECONDS)

    def stop(self) -> None:
        """End the worker (politely: the pipe's end; then SIGKILL) and close the pipe."""
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (OSError, EOFError, ValueError):
                pass
            self.process.join(1.0)
        self.kill()
        try:
            self.conn.close()
        except OSError:
            pass
        self.process = self.conn = None


def start_workers(script_path: str, function_name: str, count: int, start_method: str, label: str) -> list[Worker]:
    """``count`` started workers, each with the script imported; RuntimeError when they cannot
    start or the script does not load (once, at the shard's start)."""
    context = multiprocessing.get_context(start_method)
    workers = [Worker(context, script_path, function_name, f"mirageflow-{label}-{i}") for i in range(count)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            try:
                error = w.ready()
            except WorkerDied as e:
                raise RuntimeError(
                    f"processor '{label}': its worker processes (start_method {start_method}) did not start ({e}); "
                    "the log above has the workers' traceback"
                ) from None
            if error:
                raise RuntimeError(f"processor '{label}': {error}")
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def load_problem(script_path: str, function_name: str, timeout: float = START_TIMEOUT_SECONDS) -> tuple[str, str] | None:
    """Import the script in a worker process of its own, as every worker will: (``script`` or
    ``function``, why) when it cannot be used, else None. The caller (the driver's preflight)
    is never at risk: a script that exits, hangs or crashes at import is a problem named here."""
    context = multiprocessing.get_context("spawn")
    worker = Worker(context, script_path, function_name, "mirageflow-check")
    try:
        worker.start()
        answer = worker._receive(timeout)
    except WorkerDied as e:
        if e.killed:
            return "script", f"importing it took more than {timeout:g} s"
        return "script", f"importing it ended its process ({e})"
    finally:
        worker.stop()
    _, error, kind, detail = answer
    return None if error is None else (kind or "script", detail or error)
