"""What is left of a run: the one derivation of its progress, rate and ETA, and of the GPU-hours still needed.

``run_progress`` is the one place the run's figures now are derived: the driver's live line
(report/terminal.py) and `mmirage status` (cli.py) both show its ``RunProgress``, with the same
texts (``work_text``, ``rate_text``, ``eta_text``), so the same files give the same rows, rate and
ETA in both. The report (report.html, summary.md, metrics.json) shows no ETA: a finished run has
none; metrics.json's ``gpu_hours_remaining_estimate`` is ``gpu_hours_remaining`` below.

The rule, one for every reader:

- units are samples (rows when n_samples is 1). Done: the done shards' status.json, every other
  shard's progress.json (rows resumed from a checkpoint included: they are done). Left: the run's
  size (the dataset indices, ``indexed_rows``) less what is done.
- the rate is the run's now: the generating shards' own rates, summed (each shard's progress.json,
  over its last 3 minutes: rows resumed from a checkpoint never read as speed, a slow model load
  never as slowness). ``shard_rate`` reads one shard's, ``running_rate`` sums them.
- the ETA is the units left over that rate (``eta_seconds``: also a shard's own, in its
  progress.json). Shards not started yet are in the units left, at the rate now: as many shards at
  a time as run now, and without the model loads still to come (a rough figure).
- no rate, no ETA (never a guess): "n/a" with the reason while no shard runs, while the running
  ones load (not generating yet), while a generating shard has no rate yet (its requests are in
  flight: a batch that has not returned; a sum without it would undercount), or while the run's
  size is unknown (the index jobs have not run). 0 when every shard is done.

``gpu_hours_remaining`` projects the GPU-hours from the completed shards' mean (without one, the
running shards extrapolate their own elapsed time over their fraction done): a rough figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mirageflow.numbers import fmt_rate, percent
from mirageflow.state.records import ProgressRecord, ShardStats, StatusRecord
from mirageflow.stats.formulas import human_duration

if TYPE_CHECKING:
    from mirageflow.state.shards import ShardState


def eta_seconds(units_left: float | None, rate: float | None) -> float | None:
    """Seconds until ``units_left`` more units are done at ``rate`` units/s; None without a rate (never a guess)."""
    if not rate or units_left is None:
        return None
    return max(0, units_left) / rate


def shard_rate(progress: ProgressRecord) -> float | None:
    """A running shard's units (samples; rows when n_samples is 1) per second over its rate window, as its
    progress.json says; None when nothing finished in the window. A progress.json written before samples were
    counted apart has rows_per_sec only."""
    rate = progress.get("samples_per_sec")
    return progress.get("rows_per_sec") if rate is None else rate


def running_rate(running: list[ProgressRecord]) -> tuple[float, float | None] | None:
    """(units/s, output tokens/s) of the run now: the generating shards' own rates, summed. None unless every
    generating shard has a rate (a shard without one is not idle: its batch may be in flight)."""
    generating = [p for p in running if p.get("phase") == "generating"]
    own = [shard_rate(p) for p in generating]
    if not generating or not all(own):
        return None
    tokens = [p["tokens_per_sec"] for p in generating if p.get("tokens_per_sec") is not None]
    return sum(own), (sum(tokens) if tokens else None)


@dataclass
class WorkDone:
    """Units a run has done, summed over its shards' files: a done shard's status.json stats
    (``add_done``), any other shard's progress.json (``add_progress``: running, failed, or done and
    not yet recorded; rows resumed from a checkpoint included). The live line keeps one for its done
    shards (read once) and adds the others' on each tick (``plus``)."""

    n_samples: int = 1
    rows: int = 0
    samples: int = 0  # units: samples (rows when n_samples is 1)

    def add_done(self, stats: ShardStats | None) -> None:
        from mirageflow.state.shards import units_of

        units = units_of(stats)
        self.samples += units
        self.rows += units // max(1, self.n_samples)

    def add_progress(self, progress: ProgressRecord) -> None:
        from mirageflow.state.shards import progress_work

        rows, samples, _ = progress_work(progress, max(1, self.n_samples))
        self.rows += rows
        self.samples += samples

    def plus(self, progress: list[ProgressRecord]) -> WorkDone:
        """A copy with these progress.json's work added."""
        out = replace(self)
        for p in progress:
            out.add_progress(p)
        return out


@dataclass(frozen=True)
class RunProgress:
    """A run's progress now (``run_progress``): what the live line and `mmirage status` show of it."""

    n_samples: int
    rows_done: int
    samples_done: int
    rows_total: int | None  # None: the run's size is unknown (the dataset indices are not written yet)
    rate: float | None  # units (samples; rows when n_samples is 1) per second, now
    tokens_rate: float | None  # output tokens per second, now
    eta_seconds: float | None  # until every shard is done; None: unknown (``eta_why`` says why)
    why: str = ""  # why there is no rate
    eta_why: str = ""  # why there is no ETA

    @property
    def unit(self) -> str:
        return "rows" if self.n_samples == 1 else "samples"

    def work_text(self) -> str:
        """The work done of the run's: rows 16/40 (40%); with n_samples > 1, rows 8/20, samples 16/40 (40%)."""
        rows, samples, total = self.rows_done, self.samples_done, self.rows_total
        if self.n_samples == 1:
            return f"rows {rows:,}/{total:,} ({percent(rows, total)})" if total else f"rows {rows:,}"
        if not total:
            return f"rows {rows:,}, samples {samples:,}"
        samples_total = total * self.n_samples
        return f"rows {rows:,}/{total:,}, samples {samples:,}/{samples_total:,} ({percent(samples, samples_total)})"

    def rate_text(self) -> str:
        """The rate now: 3.00 rows/s, 150 tok/s; or rows/s n/a (why)."""
        if self.rate is None:
            return f"{self.unit}/s n/a ({self.why})"
        return f"{fmt_rate(self.rate)} {self.unit}/s, {fmt_rate(self.tokens_rate)} tok/s"

    def eta_text(self) -> str:
        """ETA 00:01:24, or ETA n/a (why)."""
        return f"ETA {human_duration(self.eta_seconds)}" if self.eta_seconds is not None else f"ETA n/a ({self.eta_why})"


def run_progress(work: WorkDone, running: list[ProgressRecord], rows_total: int | None, all_done: bool = False) -> RunProgress:
    """The run's progress, rate and ETA (the rule is in this module's docstring).

    ``work``: every shard's work (``WorkDone``), the running ones' included; ``running``: the
    running shards' progress.json; ``rows_total``: the run's source rows (``indexed_rows``);
    ``all_done``: every shard is done. The live line and `mmirage status` (``status_progress``) call it."""
    n = max(1, work.n_samples)
    rows, samples = work.rows, work.samples
    if rows_total:  # what the files say never adds up to more than the run has
        rows, samples = min(rows, rows_total), min(samples, rows_total * n)
    summed = running_rate(running)
    rate, tokens_rate = summed if summed is not None else (None, None)
    why = "" if summed is not None else _no_rate(running)
    if all_done:
        eta, eta_why = 0.0, ""
    elif rate is None:
        eta, eta_why = None, "no shard running" if not running else "no rate yet"
    elif not rows_total:
        eta, eta_why = None, "the run's size is not indexed yet"
    else:
        eta, eta_why = eta_seconds(rows_total * n - samples, rate), ""
    return RunProgress(n, rows, samples, rows_total, rate, tokens_rate, eta, why, eta_why)


def _no_rate(running: list[ProgressRecord]) -> str:
    """Why the running shards give the run no rate (``running_rate`` is None)."""
    generating = [p for p in running if p.get("phase") == "generating"]
    if not running:
        return "no shard running"
    if not generating:
        return "not generating yet"
    without = [p for p in generating if not shard_rate(p)]
    if len(without) < len(generating):
        return f"{len(without)} of {len(generating)} generating shards have no rate yet"
    covered = max(float(p.get("rate_window_seconds") or 0.0) for p in without)
    return "nothing finished yet" if covered < 1.0 else f"nothing finished in the last {covered:.0f} s"


def work_of(states: list[ShardState], n_samples: int) -> WorkDone:
    """Every shard's work from its state (`mmirage status`): a done shard's status.json, the
    others' progress.json (running, failed, or finished and not yet recorded; not a stale one's)."""
    work = WorkDone(n_samples)
    for s in states:
        if s.state == "done":
            work.add_done(s.stats)
        elif s.progress and (s.state in ("running", "failed") or not s.stale):
            work.add_progress(s.progress)
    return work


def status_progress(states: list[ShardState], n_samples: int, rows_total: int | None) -> RunProgress:
    """``run_progress`` of the shard states (`mmirage status`)."""
    running = [s.progress or {} for s in states if s.state == "running"]
    return run_progress(work_of(states, n_samples), running, rows_total, all_done=all(s.state == "done" for s in states))


def _extrapolated(progress: ProgressRecord | None) -> float | None:
    """A running shard's whole runtime, from its elapsed time over its fraction done (None before it knows one)."""
    p = progress or {}
    return p["elapsed_seconds"] / p["fraction_done"] if p.get("fraction_done") and p.get("elapsed_seconds") else None


def gpu_hours_remaining(statuses: list[StatusRecord], states: list[ShardState] | None, num_shards: int) -> float | None:
    """Projected GPU-hours the unfinished shards still need.

    Basis: the completed shards' mean GPU-seconds (GPUs x wall time); a running shard
    needs that x (1 - its fraction done), a pending or failed one all of it. Without a
    completed shard, running shards extrapolate their own elapsed GPU-seconds.
    ``statuses``: the completed shards' status.json, each with its ``shard_id``.
    """
    by_id = {s.shard_id: s for s in (states or [])}
    unfinished = [i for i in range(num_shards) if i not in {s["shard_id"] for s in statuses}]
    if not unfinished:
        return 0.0
    done_gpu_seconds = [s["stats"].get("num_gpus", 0) * s["stats"]["runtime_seconds"] for s in statuses]
    if done_gpu_seconds:
        mean = sum(done_gpu_seconds) / len(done_gpu_seconds)
    else:
        guesses = [  # (GPUs x elapsed) / fraction, in this order: the figure metrics.json always had
            (p.get("num_gpus") or 0) * p["elapsed_seconds"] / p["fraction_done"]
            for s in by_id.values()
            if s.state == "running" and _extrapolated(p := s.progress or {}) is not None
        ]
        if not guesses:
            return None
        mean = sum(guesses) / len(guesses)
    if mean == 0:  # no shard holds a GPU (a CPU run): there are no GPU-hours to project
        return None
    left = 0.0
    for shard_id in unfinished:
        s = by_id.get(shard_id)
        fraction = (s.progress or {}).get("fraction_done") if s is not None and s.state == "running" else None
        left += mean * (1 - min(1.0, fraction or 0.0))
    return left / 3600


def indexed_rows(state_dir) -> int | None:
    """Source rows of the run, from the dataset indices (written by the index jobs); None until every one is."""
    import json

    from mirageflow.state.layout import StateLayout

    total = 0
    for path in StateLayout(state_dir).dataset_indices():
        try:
            total += int(json.loads(path.read_text())["rows"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return total or None


@dataclass(frozen=True)
class CostForecast:
    """Dollars spent, and the whole run's forecast from the cost per unit finished so far."""

    spent_usd: float
    total_usd: float | None  # None: nothing finished yet, or the run's size unknown
    units_done: int  # the basis: units (rows; samples with n_samples > 1) finished at ``spent_usd``
    unpriced_tokens: int = 0  # tokens of processors whose price is unknown: the figures leave them out
    done: str = "done"  # how the basis's rows were had: "done", or "previewed" (shard/preview.py)

    @property
    def basis(self) -> str:
        unknown = f", {self.unpriced_tokens:,} tokens of unknown price left out" if self.unpriced_tokens else ""
        return f"from {self.units_done:,} rows {self.done}{unknown}"


def cost_forecast(spent_usd: float, units_done: int, units_total: int | None, unpriced_tokens: int = 0) -> CostForecast:
    """The run's cost: ``spent_usd`` for ``units_done`` units, the ``units_total - units_done`` left at
    the same cost per unit. The one derivation of the forecast (metrics.json, the live line,
    ``mmirage preview`` and ``check`` from the previewed rows)."""
    if not units_done or not units_total:
        return CostForecast(spent_usd, None if units_total != units_done else spent_usd, units_done, unpriced_tokens)
    left = max(0, units_total - units_done)
    return CostForecast(spent_usd, spent_usd + left * spent_usd / units_done, units_done, unpriced_tokens)


def run_cost(states: list[ShardState], n_samples: int, units_total: int | None) -> CostForecast:
    """The run's spend (done shards' status.json, failed ones' failure.json, running ones'
    progress.json: every attempt's) and its forecast over ``units_total`` units."""
    from mirageflow.state.shards import progress_work, units_of

    spent, units, unpriced = 0.0, 0, 0
    for s in states:
        figures = s.stats if s.state == "done" else s.failure_stats if s.state == "failed" else s.progress if s.state == "running" else None
        if not figures:
            continue
        spent += float(figures.get("cost_usd") or 0.0)
        unpriced += int(figures.get("unpriced_tokens") or 0)
        units += progress_work(figures, n_samples)[1] if s.state == "running" else units_of(figures)
    return cost_forecast(spent, units, units_total, unpriced)
