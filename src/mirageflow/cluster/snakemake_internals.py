"""What the workflow needs from Snakemake beyond its documented API, in one place.

Snakemake's plugin interfaces cover executors and storage, not what the driver needs here:
forcing a job while the DAG is built, telling Snakemake that an output it marked incomplete
is complete, the running local jobs' processes, the jobs the scheduler saw fail. Each is read
from Snakemake 9's internals (the sources of 9.27 are cited where used), only through this
module, and only after ``require_supported()`` accepted the installed version: another major
version fails with one clear message instead of a wrong run.

**Stopping** (``forward_stop_signals``, installed by the Snakefile's onstart hook in the
driver). Snakemake's local executor runs each job's shell command as a child of the driver,
in the driver's process group (snakemake/shell.py, ``shell._processes``). A terminal's
Ctrl-C reaches every process of the group; a ``kill -INT <driver>`` (a script, a supervisor,
tmux) reaches the driver alone: it raises KeyboardInterrupt in the scheduler, which then
waits for the running jobs to end by themselves (executors/local.py ``cancel``:
``pool.shutdown()``), hours for a real shard; SIGTERM makes it "exit after finishing the
running jobs" (scheduling/job_scheduler.py ``exit_gracefully``). So the driver's handlers
forward the first SIGINT/SIGTERM to each running job's process (the process the job's shell
runs, not the shell: bash would die of SIGTERM and leave the job unwatched), then let
Snakemake's handlers do what they do. A job stops within seconds, committing what finished
(mirageflow/shard/signals.py); a job that already got the signal with its group ignores the
second one. The signal is remembered (``interrupted_by``): the run summary says
"interrupted", and Snakemake's error blocks for the jobs that exited on it (a
``RuleException: CalledProcessError ... exit status 130`` and "Error in rule", and its
closing "At least one job did not complete successfully") are not printed: the jobs were
stopped, they did not fail.

**The command line** (``parse_command_line``): the executor a snakemake command names, its
profiles applied, read with Snakemake's own parser (mirageflow/cluster/executor.py).

**Scheduler timers** (``cancel_scheduler_timers``): Snakemake's scheduler rate-limits job
starts (``--max-jobs-per-timespan``, by default ``100/1s``): after each scheduling round it
starts a ``threading.Timer`` of one timespan that wakes it again
(scheduling/job_scheduler.py ``_schedule_reevalutation``). Those timers are not daemon
threads, so when the last job has finished the interpreter waits for the last one before
it exits: every run, local or on SLURM, ended ~1 s after its summary (measured with py-spy on
Snakemake 9.27: 1.09 s of the driver's exit spent in ``threading._shutdown``;
scripts/bench/small_run.py). When the scheduler has returned (onsuccess/onerror), no job is
left to wake it for, so the timers it left are cancelled; only timers whose callback comes
from Snakemake's scheduler are touched.

**Incomplete markers** (``clear_incomplete``). Snakemake marks a job's outputs incomplete
when it starts and clears the mark when it sees the job end; a driver stopped while a job
finished leaves the mark on a complete file, and the next run refuses it
(IncompleteFilesException) unless told ``--rerun-incomplete``. The workflow's input functions
know better for its own outputs: a shard's status.json that is a verified success is
complete, any other marked output is made again (mirageflow/state/inputs.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import threading
from typing import Any, Sequence

from mirageflow.errors import MirageflowError

log = logging.getLogger(__name__)

SUPPORTED_MAJOR = 9  # the internals below are Snakemake 9's (read in 9.27)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# the processes a job's shell command runs in: a signal goes to the shell's children
SHELLS = frozenset({"bash", "sh", "dash", "zsh"})

_checked: list[str] = []


class UnsupportedSnakemake(MirageflowError, RuntimeError):
    """The installed Snakemake is not a version whose internals this module knows."""


def require_supported() -> None:
    """The one version check: Snakemake 9.x, else UnsupportedSnakemake naming what is installed."""
    if _checked:
        return
    import snakemake

    version = getattr(snakemake, "__version__", "unknown")
    major = version.split(".", 1)[0]
    if major != str(SUPPORTED_MAJOR):
        raise UnsupportedSnakemake(
            f"mirageflow needs Snakemake {SUPPORTED_MAJOR}.x (its workflow glue reads Snakemake {SUPPORTED_MAJOR}'s "
            f"internals: mirageflow/cluster/snakemake_internals.py); this is Snakemake {version}"
        )
    _checked.append(version)


# --------------------------------------------------------------------------- at parse


def parse_command_line(argv: Sequence[str]):
    """Snakemake's parsed arguments of a command line (without the program), profiles applied
    (snakemake/cli.py ``parse_args``), its "Using profile" lines kept quiet. Raises what the
    parser raises (SystemExit on what it does not know)."""
    require_supported()
    from snakemake.cli import parse_args

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _parser, args = parse_args(list(argv))
    return args


# --------------------------------------------------------------------------- while the DAG is built


def force(workflow: Any, path: str) -> bool:
    """Make the job writing ``path`` rerun, as ``--forcerun path`` would: in memory, in the DAG
    being built (snakemake/dag.py ``DAG.forcefiles``). Returns whether it was not forced yet."""
    require_supported()
    files = getattr(getattr(workflow, "dag", None), "forcefiles", None)
    if not isinstance(files, set):
        raise UnsupportedSnakemake(f"mirageflow: {path} must be made again, but this Snakemake's DAG has no forcefiles")
    if path in files:
        return False
    files.add(path)
    return True


def clear_incomplete(workflow: Any, path: str) -> bool:
    """Drop Snakemake's "incomplete" mark of ``path`` (its persistence: snakemake/persistence,
    ``_filter_incomplete_keys``/``_unmark_incomplete``; the key of a local file is its path as
    the rule names it). Returns whether it was marked. Called while the DAG is built, before
    Snakemake checks the marks (dag.py ``DAG.init``: ``check_incomplete``)."""
    require_supported()
    persistence = getattr(workflow, "persistence", None)
    if persistence is None:
        return False
    if not persistence._filter_incomplete_keys([path]):
        return False
    persistence._unmark_incomplete(path)
    return True


# --------------------------------------------------------------------------- after the run


def failed_jobs(workflow: Any) -> list:
    """The jobs the scheduler saw fail in this run (scheduling/job_scheduler.py ``failed``), a
    group job opened into its jobs; each has ``rule.name``, ``wildcards_dict`` and ``log``."""
    require_supported()
    out = []
    for job in getattr(getattr(workflow, "scheduler", None), "failed", None) or ():
        out.extend(getattr(job, "jobs", None) or [job])
    return out


def dag_jobs(workflow: Any, rule: str) -> list[dict]:
    """The wildcards of each job of ``rule`` in this run's DAG (dag.py ``DAG.jobs``: every job
    the run's targets need, run or not). A job Snakemake left out of the jobs to run stays in
    it: one below a rerun job whose inputs from it are all ancient (dag.py ``update_needrun``),
    one whose output it takes for done."""
    require_supported()
    dag = getattr(workflow, "dag", None)
    if dag is None:
        raise UnsupportedSnakemake("mirageflow: this Snakemake's workflow has no DAG to read the run's jobs from")
    return [dict(job.wildcards_dict) for job in dag.jobs if job.rule.name == rule]


SCHEDULER_MODULE = "snakemake.scheduling"


def _from_scheduler(thread: threading.Thread) -> bool:
    function = getattr(thread, "function", None)
    return isinstance(thread, threading.Timer) and getattr(function, "__module__", "").startswith(SCHEDULER_MODULE)


def cancel_scheduler_timers() -> int:
    """Cancel the scheduler's pending wake-up timers (the run has ended); returns how many."""
    timers = [t for t in threading.enumerate() if _from_scheduler(t) and t.is_alive()]
    for timer in timers:
        timer.cancel()
    return len(timers)


# --------------------------------------------------------------------------- stopping


_STOP: dict = {"signum": None, "installed": False}
_STOP_LOCK = threading.Lock()


def interrupted_by() -> int | None:
    """The signal that stopped this driver's run (SIGINT/SIGTERM), or None."""
    return _STOP["signum"]


def running_job_processes() -> list[int]:
    """The pids of the local jobs running now: the process each job's shell command runs (the
    shell's children; the shell itself when it runs none yet, or when it exec'ed the command)."""
    import psutil
    from snakemake.shell import shell

    with shell._lock:
        shells = [p.pid for p in shell._processes.values()]
    pids = []
    for pid in shells:
        try:
            proc = psutil.Process(pid)
            children = proc.children() if proc.name() in SHELLS else []
        except psutil.Error:  # it ended meanwhile
            continue
        pids += [c.pid for c in children] or [pid]
    return pids


def _forward(signum: int) -> None:
    for pid in running_job_processes():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _interrupt_noise(record: logging.LogRecord) -> bool:
    """Snakemake's error blocks for jobs that ended on the driver's stop signal."""
    from snakemake_interface_logger_plugins.common import LogEvent

    event = getattr(record, "event", None)
    if event == LogEvent.JOB_ERROR:  # "Error in rule shard: ..." of a job that was stopped
        return True
    exception = getattr(record, "exception", None)
    if event == LogEvent.ERROR and exception == "WorkflowError":  # its closing line, after our summary
        return "At least one job did not complete successfully" in record.getMessage()
    if event == LogEvent.ERROR and exception in ("RuleException", "CalledProcessError"):
        text = record.getMessage()  # "... returned non-zero exit status 130." / "... died with <Signals.SIGINT: 2>."
        signum = interrupted_by()
        name = signal.Signals(signum).name
        return f"exit status {128 + signum}." in text or f"<Signals.{name}:" in text
    return False


class _QuietInterrupts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return interrupted_by() is None or not _interrupt_noise(record)


def forward_stop_signals(logger: logging.Logger | None = None) -> None:
    """In the driver (the onstart hook: after the scheduler installed its own SIGTERM handler):
    the first SIGINT/SIGTERM goes on to the running local jobs, then to Snakemake's handler.
    Called again for another run in the same process, it starts afresh (no signal seen yet)."""
    require_supported()
    if threading.current_thread() is not threading.main_thread():
        return
    _STOP["signum"] = None
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        previous = getattr(previous, "forwards_to", previous)  # ours, from an earlier run: what it wrapped

        def handler(received, frame, previous=previous):
            with _STOP_LOCK:
                first = _STOP["signum"] is None
                if first:
                    _STOP["signum"] = received
            if first:
                _forward(received)
            if callable(previous):
                previous(received, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(received, signal.SIG_DFL)
                os.kill(os.getpid(), received)

        handler.forwards_to = previous
        signal.signal(signum, handler)
    if not _STOP["installed"]:
        (logger or logging.getLogger("snakemake.logging")).addFilter(_QuietInterrupts())
        _STOP["installed"] = True
