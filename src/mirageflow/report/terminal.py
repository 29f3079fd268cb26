"""What the Snakemake driver prints about the run: live progress while shards run, and a
short summary when the run ends (success or failure).

The Snakefile's ``onstart``/``onsuccess``/``onerror`` handlers call ``on_start``,
``on_success`` and ``on_error``; they run in the driver only (Snakemake runs no hooks in
dry runs, and a cluster job re-parsing the Snakefile is not the main process). Nothing
here may fail the run: every error is logged at debug level and swallowed.

Live progress: a daemon thread reads the shards' ``progress.json`` files (the shards
rewrite them every 5 s) and prints one line at most every ``interval`` seconds while a
shard runs: shards done / running / failed, then the run's rows done / total (and samples,
with n_samples > 1; a percentage never passes 100 %), rows/s and tokens/s and ETA as
state/remaining.py's ``run_progress`` derives them, the one derivation `mmirage status`
shows too (no rate, no ETA: the line says why not; no window of this thread's own). A
shard is done when the state contract says so (mirageflow.state.shards.is_done: its
status.json belongs to the current records fingerprint), so an edited pipeline's stale
shards are not counted. The interval is 10 s when stderr is a terminal and 60 s otherwise
(a SLURM driver's log); ``$MIRAGEFLOW_PROGRESS_SECONDS`` overrides it (0 turns the lines off).

The summary: shards done / failed, rows ok / failed by class, tokens/s, and where the
merged output, report.html and the failed rows are; for each failed shard one paragraph
from its failure.json (never a traceback: that stays in the shard's log), which says when
a retry would fail the same way (every failed row failed on a deterministic error class,
``mirageflow.errors.RowErrorClass``). Jobs Snakemake saw fail are named too: a shard job
that left no failure.json (its disk was full, its config file was damaged, it was killed)
and jobs of other rules, each with the last error line of its log.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mirageflow.config.types import PipelineConfig
from mirageflow.errors import DETERMINISTIC_CLASSES, EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK
from mirageflow.numbers import fmt_rate
from mirageflow.state import layout as L
from mirageflow.state.records import read
from mirageflow.state.remaining import RunProgress, WorkDone, cost_forecast, indexed_rows, run_progress
from mirageflow.state.shards import (
    PROGRESS_STALE_SECONDS,
    ShardState,
    is_done,
    process_gone,
    recorded_fingerprint,
)

log = logging.getLogger(__name__)

ENV_INTERVAL = "MIRAGEFLOW_PROGRESS_SECONDS"
TTY_INTERVAL = 10.0
LOG_INTERVAL = 60.0


# --------------------------------------------------------------------------- failures


def repeats_identically(failure_stats: dict | None, error: str | None = None) -> str | None:
    """The error class when every failed row of a failed shard failed on one deterministic class
    (a retry resumes with those rows failed, and the rest fail the same way), else None.

    Only for shards that failed on their error budget (``error`` mentions it, or is not given).
    """
    st = failure_stats or {}
    by_class = {k: v for k, v in (st.get("rows_failed_by_class") or {}).items() if v}
    if not by_class or not all(k in DETERMINISTIC_CLASSES for k in by_class):
        return None
    if error is not None and "rows failed" not in error:  # an engine crash, a signal: not the rows' fault
        return None
    return ", ".join(sorted(by_class, key=lambda k: -by_class[k]))


def first_row_error(errors_path: Path, classes: set[str] | None = None) -> dict | None:
    """The first row error in an errors.jsonl (of one of ``classes`` when given)."""
    try:
        with open(errors_path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f):
                if n > 10_000:
                    break
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and (classes is None or entry.get("error") in classes):
                    return entry
    except OSError:
        return None
    return None


def _short_error(error: str | None) -> str:
    text = str(error or "no error recorded")
    for prefix in ("ShardFailed: ", "EngineFailed: "):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    text = " ".join(lines[:4]) + (" ..." if len(lines) > 4 else "")
    return text if len(text) <= 800 else text[:797] + "..."


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else text + "."


def failure_paragraph(shard: ShardState, state_dir: str | Path, retry_hint: str | None = None) -> str:
    """One paragraph about a failed shard."""
    shard_id = shard.shard_id
    failure = shard.failure or {}
    fst = failure.get("stats") or {}
    error = shard.error if shard.error is not None else failure.get("error")
    paths = L.StateLayout(state_dir)
    text = _sentence(f"shard {shard_id} failed: {_short_error(error)}")
    if not failure:  # no failure.json (killed, a full disk): what its log says last
        last = last_error_line(paths.shard_log(shard_id))
        if last:
            text += " " + _sentence(f"The last error in its log: {last}")
    same = repeats_identically(fst, str(error or ""))
    errors_path = paths.errors(shard_id)
    if same:
        example = first_row_error(errors_path, set(same.split(", ")))
        if example:
            text += " " + _sentence(f"First failed row (source index {example.get('source_index')}): {str(example.get('message'))[:300]}")
        text += (
            f" Every failed row failed with {same}, which depends on the config, prompt or data: "
            "a retry would fail the same way. Fix the config or prompt (try it with `mmirage preview`), then run again."
        )
    elif shard.signal:
        text += " It was stopped by a signal; run the same command again to resume from its last commit."
    elif retry_hint:
        text += f" {retry_hint}"
    text += f" Log: {paths.shard_log(shard_id)}"
    if _nonempty(errors_path):
        text += f"; failed rows: {errors_path}"
    return text + "."


# --------------------------------------------------------------------------- live progress


def progress_interval(stream=None, environ=os.environ) -> float:
    value = environ.get(ENV_INTERVAL)
    if value not in (None, ""):
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
    stream = stream or sys.stderr
    try:
        return TTY_INTERVAL if stream.isatty() else LOG_INTERVAL
    except (AttributeError, ValueError):
        return LOG_INTERVAL


@dataclass
class _Scan:
    """One tick's look at the shards not done (``LiveProgress._scan``)."""

    running: list[dict]  # progress.json of each running shard
    failed: int
    others: list[dict]  # progress.json of the shards neither running nor done (failed, or done without status.json yet)
    other_cost: float = 0.0  # their dollars (progress.json's cost_usd)


class LiveProgress:
    """Reads the shards' progress.json files and makes one line of the run's progress.

    A done shard (``is_done``: a status.json of the current records fingerprint) is read
    once and remembered; each tick stats every other shard's progress.json and reads only
    the fresh ones, so a tick over 100,000 shards is a stat per unfinished shard. A
    progress.json older than the records fingerprint belongs to an earlier config and is
    ignored. ``fingerprint``: the current records fingerprint (None: every status.json counts).
    """

    def __init__(
        self, state_dir: str | Path, num_shards: int, interval: float, emit: Callable[[str], None],
        clock: Callable[[], float] = time.time, n_samples: int = 1, fingerprint: str | None = None,
    ):  # fmt: skip
        self.paths = L.StateLayout(state_dir)
        self.num_shards = num_shards
        self.interval = interval
        self.emit = emit
        self.clock = clock
        self.n = max(1, n_samples)
        self.fingerprint = fingerprint
        self._done_work = WorkDone(self.n)  # the done shards' work, each added once
        self._done_cost: dict[int, tuple[float, int]] = {}  # done shard -> (dollars, unpriced tokens): the shards done
        self._not_done: dict[int, float] = {}  # shard -> mtime of a status.json that is not done (stale, damaged)
        self._total_rows: int | None = None
        try:  # progress written before the fingerprint last changed is an earlier config's
            self._since = self.paths.fingerprint.stat().st_mtime if fingerprint is not None else 0.0
        except OSError:
            self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: str | None = None

    def total_rows(self) -> int | None:
        """Source rows of the run, from the dataset indices (written by the index jobs)."""
        if self._total_rows is None:
            self._total_rows = indexed_rows(self.paths.root)
        return self._total_rows

    def _done(self, shard_id: int) -> bool:
        if shard_id in self._done_cost:
            return True
        path = self.paths.status(shard_id)
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return False
        if self._not_done.get(shard_id) == mtime:  # a stale or damaged status.json, read already
            return False
        status, _why = read(path)
        if not is_done(status, self.num_shards, self.fingerprint):
            self._not_done[shard_id] = mtime
            return False
        st = status.get("stats") or {}
        self._done_work.add_done(st)
        self._done_cost[shard_id] = (float(st.get("cost_usd") or 0.0), int(st.get("unpriced_tokens") or 0))
        return True

    def line(self) -> str | None:
        """The progress line, or None when no shard runs now."""
        now = self.clock()
        scan = self._scan(now)
        if not scan.running:
            return None
        total = self.total_rows()
        progress = run_progress(self._done_work.plus(scan.others + scan.running), scan.running, total)
        parts = [
            self._shards_part(scan.running, scan.failed),
            self._work_part(progress, scan.running),
            progress.rate_text(),
            progress.eta_text(),
        ]
        cost = self._cost_part(scan, progress.samples_done, total)
        return "mirageflow: " + " | ".join(parts + ([cost] if cost else []))

    def _cost_part(self, scan: _Scan, samples: int, total: int | None) -> str | None:
        """Dollars spent and the run's forecast (state/remaining.py cost_forecast); None when nothing costs."""
        spent = sum(c for c, _ in self._done_cost.values()) + scan.other_cost
        spent += sum(float(p.get("cost_usd") or 0.0) for p in scan.running)
        unpriced = sum(u for _, u in self._done_cost.values()) + sum(int(p.get("unpriced_tokens") or 0) for p in scan.running)
        if not spent and not unpriced:
            return None
        cost = cost_forecast(spent, samples, total * self.n if total else None, unpriced)
        text = f"${spent:,.2f} spent" + (" + unknown" if unpriced else "")
        return text + (f", ~${cost.total_usd:,.2f} forecast ({cost.basis})" if cost.total_usd is not None else "")

    def _scan(self, now: float) -> _Scan:
        """The shards not done: the running ones' progress.json, how many failed, and the work of
        the others (failed, or done without status.json yet)."""
        scan = _Scan([], 0, [])
        for shard_id in range(self.num_shards):
            if self._done(shard_id):
                continue
            path = self.paths.progress(shard_id)
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if mtime < self._since:
                continue
            p, _why = read(path)
            if p is None:
                continue
            phase = p.get("phase")
            fresh = now - mtime < PROGRESS_STALE_SECONDS and not process_gone(p)
            if phase == "failed" or (phase != "done" and not fresh):
                scan.failed += 1
            elif phase != "done":
                scan.running.append(p)
                continue
            scan.others.append(p)
            scan.other_cost += float(p.get("cost_usd") or 0.0)
        return scan

    def _shards_part(self, running: list[dict], failed: int) -> str:
        """Shards done, running (and the phases of those not generating), failed."""
        text = f"shards {len(self._done_cost)}/{self.num_shards} done, {len(running)} running" + (f", {failed} failed" if failed else "")
        phases = sorted({str(p.get("phase")) for p in running} - {"generating"})
        if len(running) == 1 and phases:
            seconds = running[0].get("phase_seconds")
            text += f" ({phases[0]}" + (f" {seconds:.0f} s" if seconds is not None else "") + ")"
        elif phases:
            counts = {ph: sum(1 for p in running if p.get("phase") == ph) for ph in phases}
            text += " (" + ", ".join(f"{n} {ph}" for ph, n in counts.items()) + ")"
        return text

    def _work_part(self, progress: RunProgress, running: list[dict]) -> str:
        """Rows (and samples) done of the run's, and the requests in flight."""
        inflight = sum(int(p.get("inflight") or 0) for p in running)
        return progress.work_text() + (f", {inflight:,} in flight" if inflight else "")

    def tick(self) -> None:
        try:
            text = self.line()
        except Exception:  # never let progress lines disturb the run
            log.debug("progress line failed", exc_info=True)
            return
        if text and text != self._last:  # nothing new: say nothing
            self._last = text
            self.emit(text)

    def start(self) -> None:
        if self.interval <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="mirageflow-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


# --------------------------------------------------------------------------- the summary


def run_summary(
    pipeline: PipelineConfig, ok: bool, config_hint: str | None = None, failed_jobs: list[dict] = (),
    interrupted: int | None = None, command: str | None = None,
) -> str:  # fmt: skip
    """The run's end in a few lines (and one paragraph per failed shard or job).

    ``failed_jobs``: the jobs Snakemake saw fail (``failed_jobs(workflow)``): a shard job
    that left no failure.json, and jobs of other rules, are named with their log's last error.
    ``interrupted``: the signal that stopped the driver (SIGINT/SIGTERM): the headline says
    "interrupted", each shard it stopped says what it committed, and ``command`` (the
    driver's command line) is the one that continues.
    """
    from mirageflow.report.aggregate import compute_metrics
    from mirageflow.state.shards import count, shard_states

    state_dir = Path(pipeline.state_dir)
    states = shard_states(state_dir, pipeline.num_shards, pipeline.shard.lease_timeout_seconds, recorded_fingerprint(state_dir))
    agg = compute_metrics(state_dir, pipeline.num_shards, pipeline.shard.lease_timeout_seconds, states=states)["aggregate"]
    counts = count(states)
    # shards a stop signal ended (the driver's, forwarded, or their own: a time limit)
    stopped = [s for s in states if s.state == "failed" and s.signal] if interrupted else []
    failed = [s for s in states if s.state == "failed" and s not in stopped]
    named = {s.shard_id for s in failed + stopped}
    others = [j for j in failed_jobs if not (j["rule"] == "shard" and _job_shard(j) in named)]
    lines = [
        f"{_headline(ok, interrupted, counts['done'] == pipeline.num_shards)} (state_dir {state_dir})",
        "  " + _shards_line(states, counts, len(stopped), pipeline.num_shards),
        "  " + _rows_line(agg, pipeline.n_samples),
        *_tokens_lines(agg),
        *_results_lines(pipeline, all_done=counts["done"] == pipeline.num_shards),
        *_stopped_lines(states, stopped, agg, state_dir),
        *_failure_paragraphs(failed, others, states, state_dir, config_hint),
        *_closing_lines(ok, interrupted, command, failed or others, state_dir),
    ]
    return "\n".join(lines)


def _headline(ok: bool, interrupted: int | None, all_done: bool) -> str:
    if interrupted:
        return f"mirageflow: run interrupted by {signal_name(interrupted)}"
    if not ok:
        return "mirageflow: run FAILED"
    return "mirageflow: run finished" if all_done else "mirageflow: run stopped"


def _shards_line(states: list[ShardState], counts: dict, stopped: int, num_shards: int) -> str:
    """Shards done, stopped, failed, running and not run (a stale status.json said so)."""
    shards = f"shards: {counts['done']} of {num_shards} done"
    if stopped:
        shards += f", {stopped} stopped"
    if counts["failed"] - stopped:
        shards += f", {counts['failed'] - stopped} failed"
    if counts["running"]:
        shards += f", {counts['running']} still running"
    if counts["pending"]:
        stale = sum(1 for s in states if s.stale)
        shards += f", {counts['pending']} not run" + (f" ({stale} with a stale status.json of an earlier config)" if stale else "")
    return shards


def _rows_line(agg: dict, n: int) -> str:
    """Rows (samples) ok and failed by class, filtered."""
    by_class = agg.get("rows_failed_by_class") or {}
    ok_rows = (agg.get("total_rows_processed") or 0) + (agg.get("rows_processed_failed_shards") or 0)
    rows = f"{'rows' if n == 1 else 'samples'}: {ok_rows:,} ok, {agg.get('total_rows_failed') or 0:,} failed"
    if by_class:
        rows += " (" + ", ".join(f"{k} {v:,}" for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])) + ")"
    if agg.get("total_rows_filtered"):
        rows += f", {agg['total_rows_filtered']:,} filtered"
    if n > 1:
        rows += f" ({n} samples per row: one record each)"
    return rows


def _tokens_lines(agg: dict) -> list[str]:
    if not agg.get("total_output_tokens"):
        return []
    wall = f" (wall clock {agg['wall_clock_runtime_human']} while shards ran)" if agg.get("wall_clock_runtime_human") else ""
    return [f"  output tokens: {agg['total_output_tokens']:,}, {fmt_rate(agg.get('tokens_per_sec'))} tok/s over generation{wall}"]


def _results_lines(pipeline: PipelineConfig, all_done: bool) -> list[str]:
    """Where the outputs and the report are, and the previous run's results kept until this run's replace them."""
    from mirageflow.state.pipeline import previous_results

    paths = L.StateLayout(pipeline.state_dir)
    previous = previous_results(pipeline)
    kept = {str(p) for p in previous["outputs"]} if previous else set()
    lines = []
    if all_done:
        for ds in pipeline.datasets:
            merged = L.merged_dir(ds.output_dir)
            if pipeline.merge and merged.exists() and str(merged) not in kept:
                lines.append(f"  merged output: {merged}/")
            elif str(merged) not in kept:
                lines.append(f"  output: {Path(ds.output_dir)}/shard_<id>/ (not merged)")
    if paths.report_html.exists() and str(paths.report_html) not in kept:
        lines.append(f"  report: {paths.report_html} (summary.md, metrics.json beside it)")
    if previous:
        lines.append(
            f"  the previous run's results, kept until this run's replace them ({previous['why']}, {previous['since']}): "
            + ", ".join(f"{p}/" if p.is_dir() else str(p) for p in previous["outputs"])
        )
    return lines


def _stopped_lines(states: list[ShardState], stopped: list[ShardState], agg: dict, state_dir: Path) -> list[str]:
    """Where the failed rows are, and what each shard a signal stopped committed."""
    paths = L.StateLayout(state_dir)
    lines = []
    with_errors = [s.shard_id for s in states if _nonempty(paths.errors(s.shard_id))]
    if agg.get("total_rows_failed") and with_errors:
        shown = ", ".join(map(str, with_errors[:10])) + (" ..." if len(with_errors) > 10 else "")
        lines.append(f"  failed rows: {state_dir}/shard_<id>/errors.jsonl (shards {shown})")
    for s in stopped[:20]:
        lines.append(f"  shard {s.shard_id} stopped with {_committed(s)} committed")
    if len(stopped) > 20:
        lines.append(f"  ... and {len(stopped) - 20} more stopped shards")
    return lines


def _failure_paragraphs(
    failed: list[ShardState], others: list[dict], states: list[ShardState], state_dir: Path, config_hint: str | None
) -> list[str]:  # fmt: skip
    """A paragraph per failed shard, then per failed job that is not a failed shard's (20 of each at most)."""
    retry = f"Rerun it with `mmirage retry --config {config_hint}`" if config_hint else "Rerun the same command to retry it"
    retry += " (it resumes from its last commit)."
    lines = []
    for s in failed[:20]:
        lines += ["", failure_paragraph(s, state_dir, retry_hint=retry)]
    if len(failed) > 20:
        lines.append(f"... and {len(failed) - 20} more failed shards: mmirage status --config {config_hint or '<config>'}")
    for job in others[:20]:
        lines += ["", job_paragraph(job, states)]
    return lines


def _closing_lines(ok: bool, interrupted: int | None, command: str | None, named_failures, state_dir: Path) -> list[str]:
    """How to continue an interrupted run; where to look when a run failed and nothing above says why."""
    if interrupted:
        return ["", "Nothing finished is lost. Run the same command to continue: " + (command or "the snakemake command of this run")]
    if not ok and not named_failures:
        logs = L.StateLayout(state_dir).logs_dir
        return [f"No shard failed and Snakemake named no failed job: see Snakemake's error above (the logs are in {logs}/)."]
    return []


def signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _committed(shard: ShardState) -> str:
    """What a stopped shard committed, as its failure.json says ("3 rows"); "nothing" before it started."""
    committed = (shard.failure or {}).get("committed")
    return committed if isinstance(committed, str) and committed else "nothing"


def driver_command(argv: list[str] | None = None) -> str:
    """The driver's command line, as the user can run it again (``python -m snakemake`` is ``snakemake``)."""
    import shlex

    argv = list(sys.argv if argv is None else argv)
    program = Path(argv[0]).name if argv else "snakemake"
    if program in ("__main__.py", "snakemake"):
        program = "snakemake"
    return shlex.join([program, *argv[1:]])


def _job_shard(job: dict) -> int | None:
    try:
        return int(job["wildcards"]["shard"])
    except (KeyError, TypeError, ValueError):
        return None


def job_paragraph(job: dict, states: list[ShardState]) -> str:
    """One paragraph about a job Snakemake saw fail, when the shard files do not tell it:
    a shard job without failure.json, or a job of another rule; with its log's last error."""
    shard = _job_shard(job) if job["rule"] == "shard" else None
    log_path = next(iter(job.get("logs") or []), None)
    error = last_error_line(Path(log_path)) if log_path else None
    if shard is not None:
        state = next((s.state for s in states if s.shard_id == shard), None)
        text = f"shard {shard} failed: its job exited with an error and left no failure record (shard state now: {state})"
    else:
        where = ", ".join(f"{k}={v}" for k, v in (job.get("wildcards") or {}).items())
        text = f"job {job['rule']}" + (f" ({where})" if where else "") + " failed"
    text += f"; the last error in its log: {error}" if error else "; its log holds no error line (a full disk, or killed?)"
    return _sentence(text) + (f" Log: {log_path}." if log_path else "")


# a traceback's last line ("mirageflow.x.ShardFailed: ..."), or a logged ERROR line
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Failed|Busy|Refused|Interrupted|Unavailable|Mismatch)): (.*)"
)


def last_error_line(log_path: Path, tail_bytes: int = 65536) -> str | None:
    """The last error a job's log says: a traceback's exception line, else its last ERROR line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    logged = None
    for line in reversed(text.splitlines()):
        line = line.strip()
        m = _EXCEPTION_LINE.match(line)
        if m:  # the class without its module: "ShardFailed: ..."
            return _short_error(f"{m.group(1)}: {m.group(2)}")
        if logged is None and (" ERROR " in line or line.startswith("ERROR")):
            logged = line
    return _short_error(logged) if logged else None


def failed_jobs(workflow) -> list[dict]:
    """The jobs Snakemake saw fail in this run, as {rule, wildcards, logs} (group jobs opened)."""
    from mirageflow.cluster import snakemake_internals

    out = []
    try:
        jobs = snakemake_internals.failed_jobs(workflow)
    except Exception:  # the summary names no job rather than fail
        log.debug("cannot read the failed jobs", exc_info=True)
        jobs = []
    for one in jobs:
        try:
            out.append({"rule": one.rule.name, "wildcards": dict(one.wildcards_dict), "logs": [str(f) for f in one.log]})
        except Exception:  # a job object of another shape: name nothing rather than fail the summary
            log.debug("cannot read a failed job", exc_info=True)
    return sorted(out, key=lambda j: (j["rule"] != "shard", j["rule"], _job_shard(j) or 0))


# --------------------------------------------------------------------------- Snakefile handlers

_LIVE: LiveProgress | None = None


def _emit(text: str, error: bool = False) -> None:
    """Through Snakemake's logger (terminal and .snakemake/log), else stderr."""
    try:
        from snakemake.logging import logger

        (logger.error if error else logger.info)(text)
    except Exception:
        print(text, file=sys.stderr, flush=True)


def _is_driver(workflow) -> bool:
    return workflow is None or bool(getattr(workflow, "is_main_process", True))


def _config_hint(workflow) -> str | None:
    files = list(getattr(workflow, "configfiles", None) or []) if workflow is not None else []
    return str(files[-1]) if files else None


def on_start(pipeline: PipelineConfig, workflow=None) -> None:
    """onstart: start the live progress thread (driver only)."""
    global _LIVE
    if not _is_driver(workflow):
        return
    try:
        interval = progress_interval()
        if interval <= 0:
            return
        if _LIVE is not None:
            _LIVE.stop()
        _LIVE = LiveProgress(
            pipeline.state_dir, pipeline.num_shards, interval, _emit,
            n_samples=pipeline.n_samples, fingerprint=recorded_fingerprint(pipeline.state_dir),
        )  # fmt: skip
        _LIVE.start()
    except Exception:
        log.debug("cannot start live progress", exc_info=True)


def _end(pipeline: PipelineConfig, workflow, ok: bool) -> None:
    global _LIVE
    if not _is_driver(workflow):
        return
    if _LIVE is not None:
        _LIVE.stop()
        _LIVE = None
    from mirageflow.cluster.snakemake_internals import interrupted_by

    stop = interrupted_by()
    try:
        text = run_summary(
            pipeline, ok, _config_hint(workflow), [] if ok else failed_jobs(workflow), interrupted=stop,
            command=driver_command() if stop else None,
        )  # fmt: skip
    except Exception as e:  # the summary must never hide the run's own outcome
        log.debug("run summary failed", exc_info=True)
        text = f"mirageflow: no run summary ({type(e).__name__}: {e}); see `mmirage status`"
    _emit(text, error=not ok)


def on_success(pipeline: PipelineConfig, workflow=None) -> None:
    """onsuccess: stop the progress thread, print the summary; then no exit 0 while a shard
    the run targeted is not done (``targets_not_done``): its headline, and the process exits
    non-zero (SystemExit: Snakemake's command line lets it through, its lock released)."""
    _end(pipeline, workflow, ok=True)
    if not _is_driver(workflow):
        return
    from mirageflow.cluster.snakemake_internals import dag_jobs

    targets = sorted({int(j["shard"]) for j in dag_jobs(workflow, "shard")})
    headline, code = targets_not_done(pipeline, targets, _config_hint(workflow))
    if headline:
        _emit(headline, error=True)
        raise SystemExit(code)


def targets_not_done(pipeline: PipelineConfig, targets: list[int], config_hint: str | None = None) -> tuple[str | None, int]:
    """Whether a run Snakemake calls a success left a shard it targeted (``targets``: the shard
    jobs of its DAG) other than done (mirageflow.state.shards): Snakemake took a file for
    complete (a damaged or stale status.json it has no reason to rerun, a job it dropped), so
    the run did not make what it was asked. Returns the headline naming those shards with the
    command that continues, and the exit code (1 when one failed, else 3, as ``mmirage``'s);
    (None, 0) when every target is done."""
    from mirageflow.state.shards import shard_states

    if not targets:
        return None, EXIT_OK
    state_dir = Path(pipeline.state_dir)
    states = shard_states(state_dir, pipeline.num_shards, pipeline.shard.lease_timeout_seconds, recorded_fingerprint(state_dir))
    left = [s for s in states if s.shard_id in set(targets) and s.state != "done"]
    if not left:
        return None, EXIT_OK

    def why(s: ShardState) -> str:
        if s.stale:
            return "not run: its status.json is an earlier config's"
        if s.state == "pending":
            return "not run"
        return s.state + (f": {_short_error(str(s.error))}" if s.error else "")

    named = "; ".join(f"shard {s.shard_id} {why(s)}" for s in left[:10]) + (f"; ... and {len(left) - 10} more" if len(left) > 10 else "")
    again = (
        f"mmirage retry --config {config_hint}"
        if config_hint
        else driver_command() + " --forcerun " + " ".join(str(L.StateLayout(state_dir).status(s.shard_id)) for s in left)
    )
    text = (
        f"mirageflow: run NOT complete: {len(left)} of the {len(targets)} shard(s) it targeted "
        f"{'is' if len(left) == 1 else 'are'} not done, though Snakemake had nothing left to run ({named}). "
        f"Continue with: {again} (it reruns exactly the shards not done)."
    )
    return text, EXIT_FAILED if any(s.state == "failed" for s in left) else EXIT_INCOMPLETE


def on_error(pipeline: PipelineConfig, workflow=None) -> None:
    """onerror: stop the progress thread, print the summary with one paragraph per failed shard."""
    _end(pipeline, workflow, ok=False)


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False
