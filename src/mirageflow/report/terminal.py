"""What the Snakemake driver prints about the run: live progress while shards run, and a
short summary when the run ends (success or failure).

The Snakefile's ``onstart``/``onsuccess``/``onerror`` handlers call ``on_start``,
``on_success`` and ``on_error``; they run in the driver only (Snakemake runs no hooks in
dry runs, and a cluster job re-parsing the Snakefile is not the main process). Nothing
here may fail the run: every error is logged at debug level and swallowed.

Live progress: a daemon thread reads the shards' ``progress.json`` files (the shards
rewrite them every 5 s) and prints one line at most every ``interval`` seconds while a
shard runs: shards done / running / failed, rows done / total, rows/s and tokens/s (the
shards' windowed rates, summed), and an ETA at the current rate. The interval is 10 s
when stderr is a terminal and 60 s otherwise (a SLURM driver's log);
``$MIRAGEFLOW_PROGRESS_SECONDS`` overrides it (0 turns the lines off).

The summary: shards done / failed, rows ok / failed by class, tokens/s, and where the
merged output, report.html and the failed rows are; for each failed shard one paragraph
from its failure.json (never a traceback: that stays in the shard's log), which says when
a retry would fail the same way (every failed row failed on a deterministic error class).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from mirageflow.config.types import PipelineConfig
from mirageflow.prompts import error_classes
from mirageflow.stats import formulas as stats

log = logging.getLogger(__name__)

ENV_INTERVAL = "MIRAGEFLOW_PROGRESS_SECONDS"
TTY_INTERVAL = 10.0
LOG_INTERVAL = 60.0
FRESH_SECONDS = 120.0  # a progress.json older than this belongs to no running shard

# Row error classes a retry reproduces exactly: they depend on the config, the prompt or
# the data, not on chance (json_schema: a greedy model answers the same again).
DETERMINISTIC_CLASSES = frozenset(
    {"template_error", "missing_variable", "extract_error", "json_schema", "chat_template", "bad_row", "context_length",
     "invalid_unicode", "reasoning_truncated", "bad_conversation"}
) | error_classes.DETERMINISTIC


def _fmt_rate(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.2f}" if value < 10 else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


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


def failure_paragraph(shard: dict, state_dir: str | Path, retry_hint: str | None = None) -> str:
    """One paragraph about a failed shard (an entry of report.shard_states or aggregate.failed_shards)."""
    shard_id = shard["shard_id"]
    failure = shard.get("failure") or {}
    fst = failure.get("stats") or {}
    if not fst and shard.get("rows_failed_by_class") is not None:
        fst = {"rows_failed_by_class": shard.get("rows_failed_by_class")}
    error = shard.get("error") if shard.get("error") is not None else failure.get("error")
    d = Path(state_dir)
    text = _sentence(f"shard {shard_id} failed: {_short_error(error)}")
    same = repeats_identically(fst, str(error or ""))
    errors_path = d / f"shard_{shard_id}" / "errors.jsonl"
    if same:
        example = first_row_error(errors_path, set(same.split(", ")))
        if example:
            text += " " + _sentence(f"First failed row (source index {example.get('source_index')}): {str(example.get('message'))[:300]}")
        text += (
            f" Every failed row failed with {same}, which depends on the config, prompt or data: "
            "a retry would fail the same way. Fix the config or prompt (try it with `mmirage preview`), then run again."
        )
    elif shard.get("signal"):
        text += " It was stopped by a signal; run the same command again to resume from its last commit."
    elif retry_hint:
        text += f" {retry_hint}"
    text += f" Log: {d / 'logs' / f'shard_{shard_id}.log'}"
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


class LiveProgress:
    """Reads the shards' progress.json files and makes one line of the run's progress.

    A done shard (status.json) is read once and remembered; each tick stats every other
    shard's progress.json and reads only the fresh ones, so a tick over 100,000 shards is
    a stat per unfinished shard.
    """

    def __init__(self, state_dir: str | Path, num_shards: int, interval: float, emit: Callable[[str], None], clock: Callable[[], float] = time.time):
        self.state_dir = Path(state_dir)
        self.num_shards = num_shards
        self.interval = interval
        self.emit = emit
        self.clock = clock
        self._done_rows: dict[int, int] = {}  # shard -> rows, once status.json exists
        self._total_rows: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: str | None = None

    def total_rows(self) -> int | None:
        """Rows of the run, from the dataset indices (written by the index jobs)."""
        if self._total_rows is None:
            total = 0
            for path in sorted((self.state_dir / "datasets").glob("dataset_*.index.json")):
                try:
                    total += int(json.loads(path.read_text())["rows"])
                except (OSError, ValueError, KeyError, TypeError):
                    return None
            self._total_rows = total if total else None
        return self._total_rows

    def _done(self, shard_id: int, d: Path) -> bool:
        if shard_id in self._done_rows:
            return True
        try:
            status = json.loads((d / "status.json").read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(status, dict) or status.get("status") != "success":
            return False
        st = status.get("stats") or {}
        try:
            self._done_rows[shard_id] = int((st.get("rows_processed") or 0) + (st.get("rows_failed") or 0) + (st.get("rows_filtered") or 0))
        except (TypeError, ValueError):
            self._done_rows[shard_id] = 0
        return True

    def line(self) -> str | None:
        """The progress line, or None when no shard runs now."""
        now = self.clock()
        running, failed = [], 0
        rows_other = 0
        for shard_id in range(self.num_shards):
            d = self.state_dir / f"shard_{shard_id}"
            if self._done(shard_id, d):
                continue
            path = d / "progress.json"
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            try:
                p = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(p, dict):
                continue
            phase = p.get("phase")
            fresh = now - mtime < FRESH_SECONDS
            if phase == "failed" or (phase != "done" and not fresh):
                failed += 1
                rows_other += _int(p.get("rows_done"))
            elif phase != "done":
                running.append(p)
            else:  # done but status.json not seen yet
                rows_other += _int(p.get("rows_done"))
        if not running:
            return None
        done = len(self._done_rows)
        rows = sum(self._done_rows.values()) + rows_other + sum(_int(p.get("rows_done")) for p in running)
        total = self.total_rows()
        rps = [p["rows_per_sec"] for p in running if _num(p.get("rows_per_sec"))]
        tps = [p["tokens_per_sec"] for p in running if _num(p.get("tokens_per_sec"))]
        rows_per_sec = sum(rps) if rps else None
        parts = [f"shards {done}/{self.num_shards} done, {len(running)} running" + (f", {failed} failed" if failed else "")]
        phases = sorted({str(p.get("phase")) for p in running} - {"generating"})
        if len(running) == 1 and phases:
            seconds = running[0].get("phase_seconds")
            parts[0] += f" ({phases[0]}" + (f" {seconds:.0f} s" if _num(seconds) else "") + ")"
        elif phases:
            counts = {ph: sum(1 for p in running if p.get("phase") == ph) for ph in phases}
            parts[0] += " (" + ", ".join(f"{n} {ph}" for ph, n in counts.items()) + ")"
        parts.append(f"rows {rows:,}/{total:,} ({100 * rows / total:.0f}%)" if total else f"rows {rows:,}")
        parts.append(f"{_fmt_rate(rows_per_sec)} rows/s, {_fmt_rate(sum(tps) if tps else None)} tok/s")
        eta = None
        if total and rows_per_sec:
            eta = max(0, total - rows) / rows_per_sec
        parts.append(f"ETA {stats.human_duration(eta)}" if eta is not None else "ETA n/a")
        return "mirageflow: " + " | ".join(parts)

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


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v) -> int:
    return int(v) if _num(v) else 0


# --------------------------------------------------------------------------- the summary


def run_summary(pipeline: PipelineConfig, ok: bool, config_hint: str | None = None) -> str:
    """The run's end in a few lines (and one paragraph per failed shard)."""
    from mirageflow.report.aggregate import compute_metrics, shard_states

    state_dir = Path(pipeline.state_dir)
    states = shard_states(state_dir, pipeline.num_shards, pipeline.shard.lease_timeout_seconds)
    metrics = compute_metrics(state_dir, pipeline.num_shards, pipeline.shard.lease_timeout_seconds)
    agg = metrics["aggregate"]
    counts = {k: sum(1 for s in states if s["state"] == k) for k in ("done", "running", "failed", "pending")}
    head = "mirageflow: run finished" if ok and counts["done"] == pipeline.num_shards else "mirageflow: run FAILED" if not ok else "mirageflow: run stopped"
    lines = [f"{head} (state_dir {state_dir})"]
    shards = f"shards: {counts['done']} of {pipeline.num_shards} done"
    if counts["failed"]:
        shards += f", {counts['failed']} failed"
    if counts["running"]:
        shards += f", {counts['running']} still running"
    if counts["pending"]:
        shards += f", {counts['pending']} not run"
    lines.append("  " + shards)
    by_class = agg.get("rows_failed_by_class") or {}
    failed_rows = agg.get("total_rows_failed") or 0
    ok_rows = (agg.get("total_rows_processed") or 0) + (agg.get("rows_processed_failed_shards") or 0)
    rows = f"rows: {ok_rows:,} ok, {failed_rows:,} failed"
    if by_class:
        rows += " (" + ", ".join(f"{k} {v:,}" for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])) + ")"
    if agg.get("total_rows_filtered"):
        rows += f", {agg['total_rows_filtered']:,} filtered"
    lines.append("  " + rows)
    if agg.get("total_output_tokens"):
        tps = agg.get("tokens_per_sec")
        lines.append(
            f"  output tokens: {agg['total_output_tokens']:,}, {_fmt_rate(tps)} tok/s over generation"
            + (f" (wall clock {agg['wall_clock_runtime_human']})" if agg.get("wall_clock_runtime_human") else "")
        )
    if counts["done"] == pipeline.num_shards:
        for ds in pipeline.datasets:
            merged = Path(ds.output_dir) / "merged"
            if pipeline.merge and merged.exists():
                lines.append(f"  merged output: {merged}/")
            else:
                lines.append(f"  output: {Path(ds.output_dir)}/shard_<id>/ (not merged)")
    report = state_dir / "report.html"
    if report.exists():
        lines.append(f"  report: {report} (summary.md, metrics.json beside it)")
    with_errors = [s["shard_id"] for s in states if _nonempty(state_dir / f"shard_{s['shard_id']}" / "errors.jsonl")]
    if failed_rows and with_errors:
        shown = ", ".join(map(str, with_errors[:10])) + (" ..." if len(with_errors) > 10 else "")
        lines.append(f"  failed rows: {state_dir}/shard_<id>/errors.jsonl (shards {shown})")
    failed = [s for s in states if s["state"] == "failed"]
    retry = f"Rerun it with `mmirage retry --config {config_hint}`" if config_hint else "Rerun the same command to retry it"
    retry += " (it resumes from its last commit)."
    for s in failed[:20]:
        lines.append("")
        lines.append(failure_paragraph(s, state_dir, retry_hint=retry))
    if len(failed) > 20:
        lines.append(f"... and {len(failed) - 20} more failed shards: mmirage status --config {config_hint or '<config>'}")
    if not ok and not failed:
        lines.append(
            "No shard failed: a job of another rule failed (see Snakemake's error above; its log is in "
            f"{state_dir / 'logs'}/)."
        )
    return "\n".join(lines)


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
        _LIVE = LiveProgress(pipeline.state_dir, pipeline.num_shards, interval, _emit)
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
    try:
        text = run_summary(pipeline, ok, _config_hint(workflow))
    except Exception as e:  # the summary must never hide the run's own outcome
        log.debug("run summary failed", exc_info=True)
        text = f"mirageflow: no run summary ({type(e).__name__}: {e}); see `mmirage status`"
    _emit(text, error=not ok)


def on_success(pipeline: PipelineConfig, workflow=None) -> None:
    """onsuccess: stop the progress thread, print the summary."""
    _end(pipeline, workflow, ok=True)


def on_error(pipeline: PipelineConfig, workflow=None) -> None:
    """onerror: stop the progress thread, print the summary with one paragraph per failed shard."""
    _end(pipeline, workflow, ok=False)


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False
