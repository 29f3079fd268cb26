"""What is left of a run: the one derivation of the rates, the ETA and the GPU-hours still needed.

``eta_seconds`` is the one ETA formula (units left over a measured rate): a shard's
progress.json (shard/progress.py), the driver's live line (report/terminal.py) and the
run's ETA below all use it. ``shard_rate`` reads a running shard's rate from its
progress.json and ``running_rate`` sums the run's: `mmirage status` shows the one per shard,
the live line the other, so the two agree on the same files. ``remaining`` projects the whole run from the shard states
(``state.shards.ShardState``): `mmirage status` shows it, and metrics.json's
``gpu_hours_remaining_estimate`` is its GPU-hours (report/aggregate.py).

Both projections take a shard's runtime from the completed shards' mean (without one, the
running shards extrapolate their own elapsed time over their fraction done): rough figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mirageflow.state.records import ProgressRecord, StatusRecord

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


@dataclass(frozen=True)
class Remaining:
    eta_seconds: float | None  # until every shard is done, at as many shards at a time as run now; None: unknown
    gpu_hours: float | None  # GPU-hours the unfinished shards still need; None: unknown, or no shard holds a GPU


def remaining(states: list[ShardState], num_shards: int) -> Remaining:
    """The run's ETA and remaining GPU-hours, from its shards' states."""
    statuses = [{**s.status, "shard_id": s.shard_id} for s in states if s.state == "done"]
    return Remaining(run_eta(states, num_shards), gpu_hours_remaining(statuses, states, num_shards))


def _extrapolated(progress: ProgressRecord | None) -> float | None:
    """A running shard's whole runtime, from its elapsed time over its fraction done (None before it knows one)."""
    p = progress or {}
    return p["elapsed_seconds"] / p["fraction_done"] if p.get("fraction_done") and p.get("elapsed_seconds") else None


def run_eta(states: list[ShardState], num_shards: int) -> float | None:
    """Seconds until every shard is done: the running shards' own ETAs (else the mean runtime
    less their elapsed time) plus the mean runtime for each shard still to run, over as many
    shards at a time as run now (at least one). 0 when all are done; None when unknown."""
    running = [s for s in states if s.state == "running"]
    runtimes = [s.stats["runtime_seconds"] for s in states if s.state == "done"]
    if not runtimes:  # nothing done yet: running shards extrapolate their own runtime
        runtimes = [r for s in running if (r := _extrapolated(s.progress)) is not None]
    mean_runtime = sum(runtimes) / len(runtimes) if runtimes else None
    left = []
    for s in running:
        p = s.progress or {}
        if p.get("eta_seconds") is not None:
            left.append(p["eta_seconds"])
        elif mean_runtime is not None:
            left.append(max(0.0, mean_runtime - (p.get("elapsed_seconds") or 0)))
        else:
            return None
    done = sum(1 for s in states if s.state == "done")
    todo = sum(1 for s in states if s.state in ("pending", "failed"))
    if done == num_shards:
        return 0.0
    if todo and mean_runtime is None:
        return None
    return (sum(left) + todo * (mean_runtime or 0)) / max(1, len(running))


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
