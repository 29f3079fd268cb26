"""Aggregate every shard's state into metrics.json, a Markdown summary and report.html.

Which shards are done, running, failed or pending is the state contract's answer
(mirageflow.state.shards: a done shard's status.json belongs to the current records
fingerprint); damaged state files are named in a warning and in the report, never a crash,
and a damaged status.json makes ``write_report`` raise after writing the report, so the
aggregate rule fails instead of claiming success. The aggregate has MMIRAGE's keys plus our
additions; ``docs/report.md`` ("Numbers in the report") defines them.
"""

from __future__ import annotations

from collections import Counter

import logging
from pathlib import Path

from mirageflow.errors import MirageflowError, StateMismatch
from mirageflow.files import atomic_write_json, atomic_write_text
from mirageflow.numbers import fmt, is_number
from mirageflow.report import servers
from mirageflow.report.findings import diagnose, findings_markdown
from mirageflow.report.wording import ROW_LABELS, scope_sentence, unit_note
from mirageflow.shard.tally import RECORD_KEYS
from mirageflow.state import layout as L
from mirageflow.state.records import DAMAGED_CONSEQUENCE, damaged_note
from mirageflow.state.remaining import gpu_hours_remaining, indexed_rows, run_cost
from mirageflow.state.shards import ShardState, attempts_count, default_lease_timeout, shard_states
from mirageflow.stats import formulas as stats

log = logging.getLogger(__name__)

STRAGGLER_FACTOR = 1.5  # a shard slower than 1.5 x the median runtime


class DamagedStateError(MirageflowError, ValueError):
    """A shard's status.json exists but is damaged: the run is not complete, whatever Snakemake thinks."""


def check_num_shards(status: dict, path: Path, num_shards: int) -> None:
    """A status.json of a run with another num_shards refuses the report (StateMismatch)."""
    if status.get("num_shards", num_shards) != num_shards:
        raise StateMismatch(
            f"{path} comes from a run with num_shards={status['num_shards']}, the config says {num_shards}; "
            "use a fresh state_dir (and output_dir) when changing num_shards"
        )


# which shards each figure of the aggregate covers (also in metrics.json, as "figure_scope")
FIGURE_SCOPE = {
    "completed and failed shards": "total_rows_failed, rows_failed_by_class (a failed shard's rows from its failure.json); "
    "split into rows_failed_completed_shards and rows_failed_failed_shards; engine_restarts",
    "failed shards": "rows_processed_failed_shards, failed_shards",
    "completed shards": "every other figure: total_rows_processed, runtimes, throughput, tokens and tokens/s, GPU, energy, roofline",
}


def _sum(shards: list[dict], key: str) -> float:
    return sum(s["stats"].get(key) or 0 for s in shards)


def _sampled_gpus(st: dict) -> int:
    gpus = st.get("gpus")
    if gpus:
        return sum(1 for g in gpus if g.get("util_mean") is not None)
    return st.get("num_gpus") or 1


def mean_gpu_util(statuses: list[dict]) -> float | None:
    """Time-weighted mean GPU utilisation: each shard weighs its sampled seconds x sampled GPUs (not its rows)."""
    num = den = 0.0
    plain = []
    for s in statuses:
        st = s["stats"]
        if st.get("gpu_util_mean") is None:
            continue
        weight = (st.get("gpu_sampled_seconds") or 0) * _sampled_gpus(st)
        num += st["gpu_util_mean"] * weight
        den += weight
        plain.append(st["gpu_util_mean"])
    if den > 0:
        return num / den
    return sum(plain) / len(plain) if plain else None


def wall_clock(statuses: list[dict]) -> tuple[float | None, float | None]:
    """(seconds during which at least one attempt of a completed shard ran, seconds from the
    first attempt's start to the last one's finish). The first leaves out the time between
    invocations (a run stopped, resumed an hour later); the second spans it."""
    if not statuses:
        return None, None
    first = min(stats.parse_time(s["started_at"]).timestamp() for s in statuses)  # the shard's last attempt's start
    last = max(stats.parse_time(s["finished_at"]).timestamp() for s in statuses)
    intervals, ends = [], []
    for s in statuses:
        for a in s["stats"].get("attempts") or []:
            try:
                start = stats.parse_time(a["started_at"]).timestamp()
                intervals.append((start, start + float(a["runtime_seconds"])))
                # a killed attempt has no finish of its own: its start plus its runtime
                ends.append(stats.parse_time(a["finished_at"]).timestamp() if a.get("finished_at") else intervals[-1][1])
            except (KeyError, TypeError, ValueError):  # an attempt without its times: the span is all we know
                return last - first, last - first
    if not intervals:
        return last - first, last - first
    # from the first attempt's start to the last one's finish: the attempts' own clock readings, as
    # the busy time's (status.json's finished_at comes later, after the engines are closed)
    span = max(ends) - min(start for start, _ in intervals)
    busy, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy, span


def aggregate(
    statuses: list[dict], num_shards: int, missing: list[int], states: list[ShardState] | None = None, n_samples: int | None = None
) -> dict:
    """metrics.json's aggregate, section by section (docs/report.md defines each figure).
    ``statuses``: the completed shards' status.json, each with its ``shard_id``; ``n_samples``: the
    config's (records per source row), when the caller knows it; else the completed shards' (1 when
    none has completed yet)."""
    return {
        **_shards_section(statuses, num_shards, missing, states or [], n_samples),
        **_runtime_section(statuses),
        **_hardware_section(statuses),
        **_tokens_section(statuses),
        **_rates_section(statuses, num_shards, states),
        "output_tokens_per_row_hist": stats.TokenHistogram.merge([s["stats"].get("output_tokens_per_row_hist") for s in statuses]),
    }


def _failed_shards(states: list[ShardState]) -> list[dict]:
    """metrics.json's failed_shards: who failed, why, and the rows its failure.json counts."""
    failed = []
    for s in states:
        if s.state != "failed":
            continue
        fst = s.failure_stats or {}  # totals over the shard's attempts, when failure.json has them
        failed.append(
            {
                "shard_id": s.shard_id,
                "error": s.error,
                "signal": s.signal,
                "attempt": s.attempt,
                "host": s.host,
                "slurm_job_id": s.slurm_job_id,
                "finished_at": s.finished_at,
            }  # fmt: skip
            | {k: fst.get(k) for k in ("rows_processed", "rows_failed")}
            | {"rows_failed_by_class": fst.get("rows_failed_by_class"), "attempts": attempts_count(fst)}
            # the launched servers its job restarted, and the class of the death that ended it (engines/server_restarts.py)
            | {"engine_restarts": fst.get("engine_restarts") or 0, "failure_class": s.failure_class}
        )
    return failed


def _engine_restarts(shard_stats: list[dict]) -> int:
    """The run's engine restarts: the shards' own, each death counted once. The shards of one
    engine service (shards_per_engine) each record every replacement of it they lived
    through, the same death (the serving process's pid, the time, the class) in each."""
    copies = Counter(
        (d.get("pid"), d.get("at"), d.get("class"), d.get("cause")) for st in shard_stats for d in st.get("engine_deaths") or []
    )
    return int(sum(st.get("engine_restarts") or 0 for st in shard_stats)) - sum(n - 1 for n in copies.values())


def _shards_section(statuses: list[dict], num_shards: int, missing: list[int], states: list[ShardState], n_samples) -> dict:
    """Which shards are in which state, and their rows: ok, failed (by class), filtered."""
    failed = _failed_shards(states)
    # failed rows over every shard that says (completed ones, and failed ones through failure.json's stats)
    failed_by_class: dict[str, int] = {}
    for by_class in [s["stats"].get("rows_failed_by_class") for s in statuses] + [f["rows_failed_by_class"] for f in failed]:
        for k, v in (by_class or {}).items():
            failed_by_class[k] = failed_by_class.get(k, 0) + v
    rows_failed_done = int(_sum(statuses, "rows_failed"))
    rows_failed_failed = int(sum(f["rows_failed"] or 0 for f in failed))
    return {
        "total_shards": num_shards,
        # records (samples) per source row: every rows_* count and the tokens histogram count records
        "n_samples": n_samples or max((int(s["stats"].get("n_samples") or 1) for s in statuses), default=1),
        "completed_shards": len(statuses),
        "missing_shards": missing,
        "running_shards": [s.shard_id for s in states if s.state == "running"],
        "pending_shards": [s.shard_id for s in states if s.state == "pending"],
        "failed_shards": failed,
        "total_rows_processed": int(_sum(statuses, "rows_processed")),
        "total_rows_failed": rows_failed_done + rows_failed_failed,
        "total_rows_filtered": int(_sum(statuses, "rows_filtered")),  # dropped by filter steps (completed shards)
        "rows_failed_by_class": failed_by_class,
        "rows_failed_completed_shards": rows_failed_done,
        "rows_failed_failed_shards": rows_failed_failed,
        # engines restarted or reloaded inside their shards' jobs, each once (_engine_restarts)
        "engine_restarts": _engine_restarts(
            [s["stats"] for s in statuses] + [s.failure_stats or {} for s in states if s.state == "failed"]
        ),
        "rows_processed_failed_shards": int(sum(f["rows_processed"] or 0 for f in failed)),
        "figure_scope": FIGURE_SCOPE,
        "damaged_state_files": [{"shard_id": s.shard_id, **x} for s in states for x in s.damaged],
    }


def _runtime_section(statuses: list[dict]) -> dict:
    """Wall clock, the shards' runtimes (sum, min, max, percentiles), the stragglers, the rows' throughput."""
    runtimes = [s["stats"]["runtime_seconds"] for s in statuses]
    wall, span = wall_clock(statuses)
    p50 = stats.percentile(runtimes, 50)
    p95 = stats.percentile(runtimes, 95)
    stragglers = [
        {"shard_id": s["shard_id"], "runtime_seconds": s["stats"]["runtime_seconds"], "x_median": s["stats"]["runtime_seconds"] / p50}
        for s in statuses
        if p50 and s["stats"]["runtime_seconds"] > STRAGGLER_FACTOR * p50
    ]
    rows = int(_sum(statuses, "rows_processed"))
    return {
        # while at least one shard ran (the time between invocations left out), and the whole span
        "wall_clock_runtime_seconds": wall,
        "wall_clock_runtime_human": stats.human_duration(wall),
        "wall_clock_span_seconds": span,
        "wall_clock_span_human": stats.human_duration(span),
        "sum_shard_runtime_seconds": sum(runtimes),
        "sum_shard_runtime_human": stats.human_duration(sum(runtimes)),
        "min_shard_runtime_seconds": min(runtimes, default=None),
        "min_shard_runtime_human": stats.human_duration(min(runtimes, default=None)),
        "max_shard_runtime_seconds": max(runtimes, default=None),
        "max_shard_runtime_human": stats.human_duration(max(runtimes, default=None)),
        "p50_shard_runtime_seconds": p50,
        "p50_shard_runtime_human": stats.human_duration(p50),
        "p95_shard_runtime_seconds": p95,
        "p95_shard_runtime_human": stats.human_duration(p95),
        "stragglers": stragglers,
        "overall_throughput_rows_per_sec": rows / wall if wall else None,
    }


def _hardware_section(statuses: list[dict]) -> dict:
    hardware = [s.get("hardware") or {} for s in statuses]
    return {
        "mean_gpu_util_pct": mean_gpu_util(statuses),
        "num_gpus": max((s["stats"]["num_gpus"] for s in statuses), default=0),
        "gpu_names": sorted({str(h["gpu_name"]) for h in hardware if h.get("gpu_name")}),
        "driver_versions": sorted({str(h["driver_version"]) for h in hardware if h.get("driver_version")}),
    }


def _tokens_section(statuses: list[dict]) -> dict:
    """Token totals (work and records) and the phases' summed seconds."""
    return {
        "total_input_tokens": int(_sum(statuses, "input_tokens")),
        # a request's prompt counted once per choice, as vLLM's counters do (more than
        # total_input_tokens only under native n); older status files: as input_tokens
        "total_input_tokens_each_choice": int(
            sum(s["stats"].get("input_tokens_each_choice", s["stats"].get("input_tokens")) or 0 for s in statuses)
        ),
        # generated by the engines over every attempt (lost work included): the rates divide these
        "total_output_tokens": int(_sum(statuses, "output_tokens")),
        # what the records hold (shard/tally.py): their output tokens, those from the request cache, their answers
        **{f"total_{k}": int(_sum(statuses, k)) for k in RECORD_KEYS},
        "sum_model_load_seconds": _sum(statuses, "model_load_seconds"),
        "sum_warmup_seconds": _sum(statuses, "warmup_seconds"),
        "sum_generation_seconds": _sum(statuses, "generation_seconds"),
        "sum_inference_runtime_seconds": _sum(statuses, "inference_runtime_seconds"),
        "sum_write_seconds": _sum(statuses, "write_seconds"),
        "sum_engine_idle_seconds": _sum(statuses, "engine_idle_seconds"),
    }


def _rates_section(statuses: list[dict], num_shards: int, states: list[ShardState] | None) -> dict:
    """Tokens/s, GPU time (generation and allocated), the GPU-hours still needed, energy, the roofline fraction."""
    out_tokens = int(_sum(statuses, "output_tokens"))
    inference = _sum(statuses, "inference_runtime_seconds")
    # GPU time as the seed defines it (generation time x GPUs), and as allocated (shard wall x GPUs).
    gpu_gen_seconds = sum(s["stats"]["num_gpus"] * s["stats"]["inference_runtime_seconds"] for s in statuses)
    gpu_alloc_seconds = sum(s["stats"]["num_gpus"] * s["stats"]["runtime_seconds"] for s in statuses)
    tps_gpu_wall = out_tokens / gpu_alloc_seconds if gpu_alloc_seconds > 0 else None
    days_wall = gpu_alloc_seconds / stats.SECONDS_PER_DAY / (out_tokens / 1e9) if gpu_alloc_seconds > 0 and out_tokens else None
    # energy and roofline over the shards that know them
    energy = [s for s in statuses if s["stats"].get("gpu_energy_joules") is not None]
    energy_j = sum(s["stats"]["gpu_energy_joules"] for s in energy) if energy else None
    energy_tokens = sum(s["stats"]["output_tokens"] for s in energy)
    roof = [s for s in statuses if s["stats"].get("roofline_tokens_per_sec_per_gpu")]
    roof_capacity = sum(
        s["stats"]["roofline_tokens_per_sec_per_gpu"] * s["stats"]["num_gpus"] * s["stats"]["inference_runtime_seconds"] for s in roof
    )
    return {
        "tokens_per_sec": out_tokens / inference if inference > 0 else None,
        "tokens_per_sec_per_gpu": out_tokens / gpu_gen_seconds if gpu_gen_seconds > 0 else None,
        "gpu_days_per_billion_tokens": (
            gpu_gen_seconds / stats.SECONDS_PER_DAY / (out_tokens / 1e9) if gpu_gen_seconds > 0 and out_tokens else None
        ),
        "gpu_hours_allocated": gpu_alloc_seconds / 3600,
        "tokens_per_sec_per_gpu_wall": tps_gpu_wall,
        "gpu_days_per_billion_tokens_wall": days_wall,
        # earlier names of the two figures above, kept for scripts that read them
        "tokens_per_sec_per_gpu_allocated": tps_gpu_wall,
        "gpu_days_per_billion_tokens_allocated": days_wall,
        "gpu_hours_remaining_estimate": gpu_hours_remaining(statuses, states, num_shards),
        "gpu_energy_joules": energy_j,
        "joules_per_1k_output_tokens": energy_j / (energy_tokens / 1000) if energy_j is not None and energy_tokens else None,
        "roofline_fraction": out_tokens_of(roof) / roof_capacity if roof_capacity > 0 else None,
    }


def out_tokens_of(shards: list[dict]) -> int:
    return sum(s["stats"]["output_tokens"] for s in shards)


# aggregate keys shown as tables of their own (or too long for one cell)
_NOT_IN_TABLE = {
    "missing_shards", "running_shards", "pending_shards", "failed_shards", "stragglers", "output_tokens_per_row_hist",
    "rows_failed_by_class", "figure_scope", "damaged_state_files", "inference_servers",
}  # fmt: skip


def _cell(value) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")


def summary_markdown(metrics: dict) -> str:
    agg = metrics["aggregate"]
    lines = [
        "# Run summary",
        "",
        f"{agg['completed_shards']} of {agg['total_shards']} shards completed"
        + (f"; missing: {agg['missing_shards']}" if agg["missing_shards"] else "")
        + ".",
        "",
        scope_sentence(agg),
        "",
    ]
    if "findings" in metrics:  # first: what the figures say to change (report/findings.py)
        lines += findings_markdown(metrics["findings"])
    if agg.get("damaged_state_files"):
        lines += ["## Damaged state files", ""]
        lines += [
            f"- {_cell(damaged_note(x['path'], x['reason']))}; {DAMAGED_CONSEQUENCE.get(x['file'], 'ignored')}"
            for x in agg["damaged_state_files"]
        ]
        lines.append("")
    lines += ["| metric | value | what |", "|---|---|---|"]
    for k, v in agg.items():
        if k in _NOT_IN_TABLE or (k.endswith("_human") and k[: -len("_human")] + "_seconds" in agg):
            continue  # a *_human figure is shown beside its *_seconds twin
        twin = k[: -len("_seconds")] + "_human" if k.endswith("_seconds") else None
        shown = f"{fmt(v)} s ({agg[twin]})" if twin in agg and is_number(v) else fmt(v)
        label = ROW_LABELS.get(k, "") + (unit_note(agg) if k in ROW_LABELS else "")
        lines.append(f"| `{k}` | {shown} | {label} |")
    if agg.get("rows_failed_by_class"):
        lines += ["", "Failed rows by error class (completed and failed shards): "
                  + ", ".join(f"{_cell(k)} {v:,}" for k, v in sorted(agg["rows_failed_by_class"].items(), key=lambda kv: -kv[1]))]  # fmt: skip
    if agg.get("failed_shards"):
        lines += [
            "",
            "## Failed shards",
            "",
            "| shard | error | signal | host | attempts | rows ok | rows failed |",
            "|---|---|---|---|---|---|---|",
        ]
        for f in agg["failed_shards"]:
            error = _cell(f.get("error"))[:300]
            lines.append(
                f"| {f['shard_id']} | {error} | {_cell(f.get('signal'))} | {_cell(f.get('host'))} | "
                f"{fmt(f.get('attempts'))} | {fmt(f.get('rows_processed'))} | {fmt(f.get('rows_failed'))} |"
            )
    if agg.get("stragglers"):
        lines += ["", f"Stragglers (> {STRAGGLER_FACTOR} x median runtime): "
                  + ", ".join(f"shard {s['shard_id']} ({s['x_median']:.1f}x)" for s in agg["stragglers"])]  # fmt: skip
    if metrics.get("deduplication"):
        lines += ["", "## Deduplication (after merge)", "",
                  "| dataset | text field | rows in | exact duplicates removed | near duplicates removed | rows out | rows without text |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for d in metrics["deduplication"]:
            if "error" in d:
                lines.append(f"| {_cell(d['error'])} | | | | | | |")
                continue
            lines.append(
                f"| {_cell(d.get('dataset'))} | `{_cell(d.get('text_field'))}` | {fmt(d.get('rows_in'))} | {fmt(d.get('exact_duplicates_removed'))} | "
                f"{fmt(d.get('near_duplicates_removed'))} | {fmt(d.get('rows_out'))} | {fmt(d.get('rows_without_text'))} |"
            )
    lines += servers.summary_lines(agg.get("inference_servers"), _cell)
    lines += [
        "", "## Shards (completed; each row covers all attempts of the shard)", "",
        "| shard | attempts | rows ok | rows failed | rows filtered | runtime s | load s | generate s | output tokens | tok/s | GPU util % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    cells = [
        "rows_processed", "rows_failed", "rows_filtered", "runtime_seconds", "model_load_seconds", "inference_runtime_seconds",
        "output_tokens", "tokens_per_sec", "gpu_util_mean",
    ]  # fmt: skip
    for s in metrics["per_shard"]:
        st = s["stats"]
        lines.append(f"| {s['shard_id']} | {fmt(s.get('attempts'))} | " + " | ".join(fmt(st.get(k)) for k in cells) + " |")
    return "\n".join(lines) + "\n"


def compute_metrics(
    state_dir: str | Path,
    num_shards: int,
    lease_timeout: float | None = None,
    fingerprint: str | None = None,
    states: list[ShardState] | None = None,
    n_samples: int | None = None,
) -> dict:
    """metrics.json's per_shard and aggregate, from the state files alone. ``lease_timeout``:
    the config's shard_params.lease_timeout_seconds (None: the schema's default);
    ``fingerprint``: the current records fingerprint (None: every status.json counts);
    ``states``: the shards' states when the caller has just read them; ``n_samples``: the
    config's, when the caller has it (the aggregate says it before any shard has completed)."""
    if states is None:
        lease_timeout = default_lease_timeout() if lease_timeout is None else lease_timeout
        states = shard_states(state_dir, num_shards, lease_timeout, fingerprint)
    paths = L.StateLayout(state_dir)
    for s in states:
        if s.other_run_num_shards is not None:  # a status.json of another run refuses the report
            check_num_shards({"num_shards": s.other_run_num_shards}, paths.status(s.shard_id), num_shards)
        for x in s.damaged:
            log.warning("%s; %s", damaged_note(x["path"], x["reason"]), DAMAGED_CONSEQUENCE[x["file"]])
    statuses = [{**s.status, "shard_id": s.shard_id} for s in states if s.state == "done"]
    missing = [s.shard_id for s in states if s.state != "done"]
    per_shard = [
        {
            "shard_id": s["shard_id"],
            "hostname": s.get("hostname"),
            "attempt": s.get("attempt"),
            "attempts": attempts_count(s["stats"]),
            "started_at": s["started_at"],
            "finished_at": s["finished_at"],
            "gpu_name": (s.get("hardware") or {}).get("gpu_name"),
            "slurm_job_id": s.get("slurm_job_id"),
            "engines": servers.engines_ran(s),
            "server_metrics": s.get("server_metrics"),
            "stats": s["stats"],
        }
        for s in statuses
    ]
    agg = aggregate(statuses, num_shards, missing, states, n_samples)
    from mirageflow.cluster.engine_service import shared_engine_summary  # shards_per_engine > 1: count each load once

    agg["shared_engines"] = shared_engine_summary(state_dir, statuses)
    agg["inference_servers"] = servers.server_aggregate(statuses)
    if agg["shared_engines"]:
        agg["sum_model_load_seconds"] = agg["shared_engines"]["sum_model_load_seconds_attributed"]
    agg.update(cost_figures(state_dir, states, agg.get("n_samples") or 1))
    return {"per_shard": per_shard, "aggregate": agg}


def cost_figures(state_dir: str | Path, states: list[ShardState], n_samples: int) -> dict:
    """Dollars spent by every shard's every attempt (done, failed, running), and the whole run's
    forecast at the cost per row done so far (state/remaining.py run_cost)."""
    rows = indexed_rows(state_dir)
    cost = run_cost(states, n_samples, rows * n_samples if rows else None)
    return {
        "cost_usd": cost.spent_usd,
        "cost_unpriced_tokens": cost.unpriced_tokens,
        "cost_forecast_usd": cost.total_usd,
        "cost_forecast_basis": cost.basis,
    }


def full_metrics(
    state_dir: str | Path, num_shards: int, lease_timeout: float | None = None, fingerprint: str | None = None,
    n_samples: int | None = None,
) -> dict:  # fmt: skip
    """What metrics.json holds (the aggregate and `mmirage stats`): compute_metrics, plus
    the SLURM accounting and the dedup counts. Only here, not in compute_metrics: `mmirage
    status` must not wait on sacct."""
    from mirageflow.data.dedup import read_dedup_counts
    from mirageflow.report.slurm_accounting import cluster_accounting

    metrics = compute_metrics(state_dir, num_shards, lease_timeout, fingerprint, n_samples=n_samples)
    metrics["cluster_accounting"] = cluster_accounting(metrics)
    metrics["deduplication"] = read_dedup_counts(state_dir)  # [] unless deduplication_params.enabled
    metrics["findings"] = diagnose(metrics, state_dir)
    return metrics


def write_report(
    state_dir: str | Path, num_shards: int, html: bool = True, lease_timeout: float | None = None, fingerprint: str | None = None,
    n_samples: int | None = None,
) -> dict:  # fmt: skip
    """Write metrics.json, summary.md and report.html (atomically, through data.writers).

    Raises DamagedStateError after writing them when a shard's status.json is damaged: the
    file exists, so Snakemake took the shard for done, but it is not; the aggregate rule fails.
    """
    metrics = full_metrics(state_dir, num_shards, lease_timeout, fingerprint, n_samples)
    paths = L.StateLayout(state_dir)
    atomic_write_json(paths.metrics, metrics)
    atomic_write_text(paths.summary, summary_markdown(metrics))
    if html:
        from mirageflow.report.html import render_html

        atomic_write_text(paths.report_html, render_html(metrics, state_dir))
    bad = [x for x in metrics["aggregate"]["damaged_state_files"] if x["file"] == L.STATUS]
    if bad:
        raise DamagedStateError(
            "; ".join(damaged_note(x["path"], x["reason"]) for x in bad)
            + f" -- shard(s) {[x['shard_id'] for x in bad]} not done: delete the damaged status.json and rerun "
            "(mmirage retry); the report lists them as failed"
        )
    return metrics
