"""An inference server run as a child of the job (not an engine): the one launcher of
``sglang_server``, ``vllm_server`` and image_gen's SGLang diffusion server.

``ServerProcess`` starts the server's command in its own process group (``start_new_session``)
with stdout and stderr appended to a log file, watches it from a daemon thread (``on_exit``
is called when it exits), waits for a health endpoint to answer 200 within a start-up
deadline, and stops the whole process tree: SIGTERM to the group, SIGKILL to what is left
after ``grace`` seconds (vLLM ignores SIGTERM while it compiles; SGLang's scheduler may
outlive its parent), also at interpreter exit. Error messages quote the log's last lines.
``classify_exit`` says why a serving one exited (an ``EngineDeathClass``), and
``classify_engine_error`` why an in-process engine's exception ends it, and ``classify_crash``
why its subprocess failed (in-process SGLang's SIGQUIT), from the job log (the same classes,
the same out-of-memory markers); the restarts of
``sglang_server``, ``vllm_server`` and the diffusion server are engines/server_restarts.py's,
one ServerProcess per start.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from mirageflow.engines.base import EngineError
from mirageflow.errors import EngineDeathClass as D
from mirageflow.redact import redact

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 30
# What a server (PyTorch, CUDA, the C++ allocator, the kernel's ENOMEM) writes when memory ran
# out; any of them in the log's tail makes an exit an out-of-memory death.
_OOM_MARKERS = (
    "out of memory", "outofmemoryerror", "memoryerror", "cannot allocate memory", "std::bad_alloc",
    "failed to allocate", "cuda_error_out_of_memory",
)  # fmt: skip


def server_flags(args: dict) -> list[str]:
    """``{"foo_bar": v}`` -> command-line flags: ``--foo-bar v`` (true -> bare ``--foo-bar``,
    false/null -> omitted, lists -> several values, mappings -> JSON)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def log_tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            tail = deque(f, maxlen=lines)
    except OSError as e:
        return f"(log unreadable: {e})"
    text = b"".join(tail).decode("utf-8", "replace").rstrip()
    return text or "(the log is empty)"


def exit_signal(rc: int) -> signal.Signals | None:
    """The signal that ended a process with exit status ``rc``: Popen's ``-N``, or a shell's
    ``128 + N`` (a ``server_command`` wrapped in a script)."""
    number = -rc if rc < 0 else rc - 128 if 128 < rc < 128 + signal.NSIG else None
    try:
        return signal.Signals(number) if number else None
    except ValueError:
        return None


# What an in-process engine's exception says when the device is left unusable (the CUDA
# context after an illegal access or a device-side assert): the engine is reloaded.
_DEVICE_ERROR_MARKERS = (
    "cuda error", "device-side assert", "cublas_status", "cudnn_status", "illegal memory access", "nccl error",
)  # fmt: skip


def classify_engine_error(error: BaseException) -> tuple[D, str] | None:
    """Why an in-process engine's ``error`` (raised by its model) ends it, and the cause in
    words: out of memory (not reloaded), a device error (reloaded), or None (not a death: a
    bug, raised as it is)."""
    text = f"{type(error).__name__}: {error}"
    cause = text.splitlines()[0][:300]
    low = text.lower()
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError" or any(m in low for m in _OOM_MARKERS):
        return D.OUT_OF_MEMORY, cause
    if any(m in low for m in _DEVICE_ERROR_MARKERS):
        return D.DEVICE_ERROR, cause
    return None


# What SGLang's subprocess watchdog logs when a child died without a traceback (utils/watchdog.py
# SubprocessWatchdog: "Subprocess scheduler_0 (pid=123) crashed with exit code -9"): its exit code.
_CRASHED_WITH_EXIT_CODE = re.compile(r"crashed with exit code (-?\d+)")


def classify_crash(tail: str | None) -> tuple[D, str]:
    """Why an in-process engine's subprocess failed (it signalled the job, as SGLang's scheduler
    does), from the job log's last lines ``tail`` (None: no log to read): the exit code its
    watchdog logged (``classify_exit``), else the log's out-of-memory or device-error markers
    (the line that has one is quoted), else an error exit."""
    tail = tail or ""
    codes = _CRASHED_WITH_EXIT_CODE.findall(tail)
    if codes:
        death_class, how = classify_exit(int(codes[-1]), tail)
        return death_class, f"a subprocess {how}"
    for death_class, markers in ((D.OUT_OF_MEMORY, _OOM_MARKERS), (D.DEVICE_ERROR, _DEVICE_ERROR_MARKERS)):
        line = next((ln for ln in reversed(tail.splitlines()) if any(m in ln.lower() for m in markers)), None)
        if line is not None:
            return death_class, f"a subprocess failed; the log says: {line.strip()[:300]}"
    return D.EXITED_WITH_ERROR, "a subprocess failed" + ("" if tail else " (no job log to tell why: stderr is not a file)")


def classify_exit(rc: int, tail: str) -> tuple[D, str]:
    """Why a server that was serving exited with ``rc``, its log's last lines ``tail``: the
    death's class and its cause in words."""
    low = tail.lower()
    marker = next((m for m in _OOM_MARKERS if m in low), None)
    sig = exit_signal(rc)
    how = f"killed by {sig.name}" if sig is not None else f"exited with code {rc}"
    if marker is not None:
        return D.OUT_OF_MEMORY, f"{how}; its log says {marker!r}"
    if sig is not None:
        return D.KILLED_BY_SIGNAL, how
    return D.EXITED_WITH_ERROR, how


class ServerProcess:
    """One server process and its log. ``name`` names it in messages ("the vLLM server")."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict | None = None, unset: tuple[str, ...] = ()):
        self.name, self.command, self.log_path, self.env = name, list(command), Path(log_path), env
        self.unset = unset  # inherited variables the command must not see (a nested srun: the step's SLURM_*)
        self.process: subprocess.Popen | None = None
        self.log_offset = 0  # where this start's lines begin in the (appended) log
        self.started = 0.0
        self.closing = False  # set before a deliberate stop: the exit is not a death
        self._killed = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, on_exit: Callable[[int], None] | None = None) -> None:
        """Start the command; ``on_exit(returncode)`` is called from a thread if it exits
        while not being stopped."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            shown = " ".join(redact(self.command))
            logf.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')} mirageflow starts: {shown}\n".encode())
            logf.flush()
            self.log_offset = logf.tell()
            self.started = time.monotonic()
            env = None if self.env is None and not self.unset else {**os.environ, **(self.env or {})}
            for name in self.unset:
                env.pop(name, None)
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        atexit.register(self.kill)
        threading.Thread(target=self._watch, args=(self.process, on_exit), name=f"{self.name}-watch", daemon=True).start()

    def _watch(self, process: subprocess.Popen, on_exit) -> None:
        rc = process.wait()
        if not self.closing and on_exit is not None:
            on_exit(rc)

    def tail(self) -> str:
        return log_tail(self.log_path, self.log_offset)

    def shown_command(self) -> str:
        return " ".join(redact(self.command))

    def died(self, rc: int) -> str:
        """The message for an exit during the run."""
        return f"{self.name} (pid {self.process.pid}) exited with code {rc} during the run; last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self.tail()}"

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def exit_cause(self, rc: int) -> tuple[D, str]:
        """Why it exited with ``rc`` while serving (classify_exit of its log's tail)."""
        return classify_exit(rc, self.tail())

    def exited_early(self) -> str | None:
        """The message when it exited before it became healthy, else None."""
        rc = self.process.poll()
        if rc is None:
            return None
        return (
            f"{self.name} exited with code {rc} before it became healthy ({self.shown_command()}); "
            f"last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self.tail()}"
        )

    def wait_healthy(
        self, base_url: str, path: str, timeout: float, poll_interval: float = 0.1, timeout_name: str = "server_start_timeout"
    ) -> float:
        """Poll ``GET base_url + path`` until it answers 200; the seconds it took since start.
        EngineError (with the log's tail) when the process exits first or ``timeout``
        seconds pass."""
        from mirageflow.transport.http_client import TransportError, get_blocking

        base_url = base_url.rstrip("/")
        deadline = time.monotonic() + timeout
        interval = poll_interval
        while True:
            exited = self.exited_early()
            if exited is not None:
                raise EngineError(exited)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineError(
                    f"{self.name} did not become healthy within {timeout_name}={timeout:g} s "
                    f"(GET {path} never answered 200); last {LOG_TAIL_LINES} lines of {self.log_path}:\n{self.tail()}"
                )
            try:
                if get_blocking(base_url + path, max(0.2, min(30.0, remaining))).status_code == 200:
                    return time.monotonic() - self.started
            except TransportError:
                pass
            time.sleep(max(0.0, min(interval, deadline - time.monotonic())))
            interval = min(interval * 1.5, 2.0)

    def terminate(self) -> None:
        """SIGTERM the server's process group now, without waiting (a stop signal reached the
        job); ``kill`` later waits for it and sweeps what is left."""
        self.closing = True
        if self.process is not None and not self._killed:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self, grace: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds."""
        process = self.process
        if process is None or self._killed:
            return
        self._killed = True
        self.closing = True
        atexit.unregister(self.kill)
        members = _process_tree(process.pid)  # before the leader goes and its children scatter
        deadline = time.monotonic() + grace
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %g s; killing it", self.name, grace)
        members = _wait_gone(members, max(0.0, deadline - time.monotonic()))
        try:
            os.killpg(process.pid, signal.SIGKILL)  # also members that outlived the leader
        except ProcessLookupError:
            pass
        _kill(members)  # children that left the group
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit after SIGKILL", self.name, process.pid)
        left = _wait_gone(members, 10)
        if left:
            log.error("processes of %s survived SIGKILL: %s", self.name, [p.pid for p in left])


def _process_tree(pid: int) -> list:
    """The server's descendants and its process group's members (psutil; [] without it)."""
    try:
        import psutil
    except ImportError:
        return []
    found = {}
    try:
        for child in psutil.Process(pid).children(recursive=True):
            found[child.pid] = child
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        try:
            if p.pid != pid and p.pid not in found and os.getpgid(p.pid) == pid:
                found[p.pid] = p
        except (OSError, psutil.Error):
            pass
    return list(found.values())


def _running(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(processes: list, timeout: float) -> list:
    """Those of ``processes`` still running after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        processes = [p for p in processes if _running(p)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.02)


def _kill(processes: list) -> None:
    for p in processes:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
