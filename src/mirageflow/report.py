"""Aggregate every shard's state into metrics.json, a Markdown summary and report.html.

A shard is ``done`` (status.json with status success), ``running`` (progress.json or
lease.json updated recently), ``failed`` (failure.json, or a progress.json that stopped
updating mid-run: the job was killed) or ``pending`` (nothing yet). The aggregate has
MMIRAGE's keys plus our additions; ``README.md`` ("Numbers in the report") defines them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mirageflow import stats
from mirageflow.data.writers import atomic_write_json, atomic_write_text

STRAGGLER_FACTOR = 1.5  # a shard slower than 1.5 x the median runtime
PROGRESS_STALE_SECONDS = 120.0  # progress.json is rewritten every 5 s while a shard lives
DEFAULT_LEASE_TIMEOUT = 300.0


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # half-written by a crashed writer: treat as absent
        return None


def load_statuses(state_dir: str | Path, num_shards: int) -> tuple[list[dict], list[int]]:
    """Successful shards' status.json contents, and the ids of shards without one."""
    found, missing = [], []
    for shard_id in range(num_shards):
        path = Path(state_dir) / f"shard_{shard_id}" / "status.json"
        try:
            with open(path) as f:
                status = json.load(f)
        except FileNotFoundError:
            missing.append(shard_id)
            continue
        if status.get("num_shards", num_shards) != num_shards:
            raise ValueError(
                f"{path} comes from a run with num_shards={status['num_shards']}, the config says {num_shards}; "
                "use a fresh state_dir (and output_dir) when changing num_shards"
            )
        if status.get("status") == "success":
            found.append(status)
        else:
            missing.append(shard_id)
    return found, missing


def shard_states(
    state_dir: str | Path, num_shards: int, lease_timeout: float = DEFAULT_LEASE_TIMEOUT, now: float | None = None
) -> list[dict]:
    """One entry per shard: ``state`` (done | running | failed | pending) and what its files say.

    Works from the files alone (on a login node or locally): a running shard rewrites
    progress.json every few seconds and heartbeats lease.json; a failed one left
    failure.json (error, signal) or a progress.json that stopped updating mid-run.
    """
    now = time.time() if now is None else now
    out = []
    for shard_id in range(num_shards):
        d = Path(state_dir) / f"shard_{shard_id}"
        status = _read_json(d / "status.json")
        failure = _read_json(d / "failure.json")
        progress = _read_json(d / "progress.json")
        lease = _read_json(d / "lease.json")
        entry = {"shard_id": shard_id, "state": "pending", "progress": progress}
        lease_age = now - lease["heartbeat"] if lease and "heartbeat" in lease else None
        progress_age = now - progress["updated_at_unix"] if progress and "updated_at_unix" in progress else None
        progress_live = progress is not None and progress.get("phase") not in ("done", "failed") and progress_age is not None
        if status is not None and status.get("status") == "success" and status.get("num_shards", num_shards) == num_shards:
            entry.update(state="done", status=status)
        elif (lease_age is not None and lease_age < lease_timeout) or (progress_live and progress_age < PROGRESS_STALE_SECONDS):
            entry.update(state="running", since_update_seconds=progress_age if progress_live else lease_age)
            entry["host"] = (progress or lease or {}).get("hostname")
            entry["slurm_job_id"] = (progress or lease or {}).get("slurm_job_id")
        elif failure is not None:
            entry.update(
                state="failed", error=failure.get("error"), signal=failure.get("signal"), attempt=failure.get("attempt"),
                host=failure.get("hostname"), slurm_job_id=failure.get("slurm_job_id"), finished_at=failure.get("finished_at"),
            )  # fmt: skip
        elif progress_live:  # stopped updating without failure.json: SIGKILL, OOM killer, node failure
            entry.update(
                state="failed", signal=None, attempt=progress.get("attempt"), host=progress.get("hostname"),
                slurm_job_id=progress.get("slurm_job_id"), finished_at=progress.get("updated_at"),
                error=f"stopped without a failure record in phase '{progress.get('phase')}' (killed?); "
                f"progress.json last updated {stats.human_duration(progress_age)} ago",
            )  # fmt: skip
        out.append(entry)
    return out


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


def gpu_hours_remaining(statuses: list[dict], states: list[dict] | None, num_shards: int) -> float | None:
    """Projected GPU-hours the unfinished shards still need.

    Basis: the completed shards' mean GPU-seconds (GPUs x wall time); a running shard
    needs that x (1 - its fraction done), a pending or failed one all of it. Without a
    completed shard, running shards extrapolate their own elapsed GPU-seconds.
    """
    by_id = {s["shard_id"]: s for s in (states or [])}
    unfinished = [i for i in range(num_shards) if i not in {s["shard_id"] for s in statuses}]
    if not unfinished:
        return 0.0
    done_gpu_seconds = [s["stats"].get("num_gpus", 0) * s["stats"]["runtime_seconds"] for s in statuses]
    if done_gpu_seconds:
        mean = sum(done_gpu_seconds) / len(done_gpu_seconds)
    else:
        guesses = []
        for st in by_id.values():
            p = st.get("progress") or {}
            if st["state"] == "running" and p.get("fraction_done") and p.get("elapsed_seconds"):
                guesses.append((p.get("num_gpus") or 0) * p["elapsed_seconds"] / p["fraction_done"])
        if not guesses:
            return None
        mean = sum(guesses) / len(guesses)
    remaining = 0.0
    for shard_id in unfinished:
        st = by_id.get(shard_id, {})
        fraction = (st.get("progress") or {}).get("fraction_done") if st.get("state") == "running" else None
        remaining += mean * (1 - min(1.0, fraction or 0.0))
    return remaining / 3600


def aggregate(statuses: list[dict], num_shards: int, missing: list[int], states: list[dict] | None = None) -> dict:
    runtimes = [s["stats"]["runtime_seconds"] for s in statuses]
    wall = None
    if statuses:
        first = min(stats.parse_time(s["started_at"]) for s in statuses)
        last = max(stats.parse_time(s["finished_at"]) for s in statuses)
        wall = (last - first).total_seconds()
    rows = int(_sum(statuses, "rows_processed"))
    out_tokens = int(_sum(statuses, "output_tokens"))
    # GPU time as the seed defines it (generation time x GPUs), and as allocated (shard wall x GPUs).
    gpu_gen_seconds = sum(s["stats"]["num_gpus"] * s["stats"]["inference_runtime_seconds"] for s in statuses)
    gpu_alloc_seconds = sum(s["stats"]["num_gpus"] * s["stats"]["runtime_seconds"] for s in statuses)
    inference = _sum(statuses, "inference_runtime_seconds")
    tps_gpu_wall = out_tokens / gpu_alloc_seconds if gpu_alloc_seconds > 0 else None
    days_wall = gpu_alloc_seconds / stats.SECONDS_PER_DAY / (out_tokens / 1e9) if gpu_alloc_seconds > 0 and out_tokens else None
    p50 = stats.percentile(runtimes, 50)
    p95 = stats.percentile(runtimes, 95)
    stragglers = [
        {"shard_id": s["shard_id"], "runtime_seconds": s["stats"]["runtime_seconds"], "x_median": s["stats"]["runtime_seconds"] / p50}
        for s in statuses
        if p50 and s["stats"]["runtime_seconds"] > STRAGGLER_FACTOR * p50
    ]
    by_state = {k: [s for s in states or [] if s["state"] == k] for k in ("running", "failed", "pending")}
    failed = [
        {k: s.get(k) for k in ("shard_id", "error", "signal", "attempt", "host", "slurm_job_id", "finished_at")}
        for s in by_state["failed"]
    ]
    # energy and roofline over the shards that know them
    energy = [s for s in statuses if s["stats"].get("gpu_energy_joules") is not None]
    energy_j = sum(s["stats"]["gpu_energy_joules"] for s in energy) if energy else None
    energy_tokens = sum(s["stats"]["output_tokens"] for s in energy)
    roof = [s for s in statuses if s["stats"].get("roofline_tokens_per_sec_per_gpu")]
    roof_capacity = sum(
        s["stats"]["roofline_tokens_per_sec_per_gpu"] * s["stats"]["num_gpus"] * s["stats"]["inference_runtime_seconds"] for s in roof
    )
    failed_by_class: dict[str, int] = {}
    for s in statuses:
        for k, v in (s["stats"].get("rows_failed_by_class") or {}).items():
            failed_by_class[k] = failed_by_class.get(k, 0) + v
    hardware = [s.get("hardware") or {} for s in statuses]
    return {
        "total_shards": num_shards,
        "completed_shards": len(statuses),
        "missing_shards": missing,
        "running_shards": [s["shard_id"] for s in by_state["running"]],
        "pending_shards": [s["shard_id"] for s in by_state["pending"]],
        "failed_shards": failed,
        "total_rows_processed": rows,
        "total_rows_failed": int(_sum(statuses, "rows_failed")),
        "rows_failed_by_class": failed_by_class,
        "wall_clock_runtime_seconds": wall,
        "wall_clock_runtime_human": stats.human_duration(wall),
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
        "mean_gpu_util_pct": mean_gpu_util(statuses),
        "num_gpus": max((s["stats"]["num_gpus"] for s in statuses), default=0),
        "gpu_names": sorted({h["gpu_name"] for h in hardware if h.get("gpu_name")}),
        "driver_versions": sorted({h["driver_version"] for h in hardware if h.get("driver_version")}),
        "total_input_tokens": int(_sum(statuses, "input_tokens")),
        "total_output_tokens": out_tokens,
        "sum_model_load_seconds": _sum(statuses, "model_load_seconds"),
        "sum_warmup_seconds": _sum(statuses, "warmup_seconds"),
        "sum_generation_seconds": _sum(statuses, "generation_seconds"),
        "sum_inference_runtime_seconds": inference,
        "sum_write_seconds": _sum(statuses, "write_seconds"),
        "sum_engine_idle_seconds": _sum(statuses, "engine_idle_seconds"),
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
        "output_tokens_per_row_hist": stats.TokenHistogram.merge([s["stats"].get("output_tokens_per_row_hist") for s in statuses]),
    }


def out_tokens_of(shards: list[dict]) -> int:
    return sum(s["stats"]["output_tokens"] for s in shards)


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


# aggregate keys shown as tables of their own (or too long for one cell)
_NOT_IN_TABLE = {"missing_shards", "running_shards", "pending_shards", "failed_shards", "stragglers", "output_tokens_per_row_hist", "rows_failed_by_class"}


def summary_markdown(metrics: dict) -> str:
    agg = metrics["aggregate"]
    lines = [
        "# Run summary",
        "",
        f"{agg['completed_shards']} of {agg['total_shards']} shards completed"
        + (f"; missing: {agg['missing_shards']}" if agg["missing_shards"] else "")
        + ".",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| `{k}` | {_fmt(v)} |" for k, v in agg.items() if k not in _NOT_IN_TABLE]
    if agg.get("failed_shards"):
        lines += ["", "## Failed shards", "", "| shard | error | signal | host |", "|---|---|---|---|"]
        for f in agg["failed_shards"]:
            error = str(f.get("error") or "").replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {f['shard_id']} | {error} | {f.get('signal') or ''} | {f.get('host') or ''} |")
    if agg.get("stragglers"):
        lines += ["", f"Stragglers (> {STRAGGLER_FACTOR} x median runtime): "
                  + ", ".join(f"shard {s['shard_id']} ({s['x_median']:.1f}x)" for s in agg["stragglers"])]  # fmt: skip
    lines += ["", "## Shards", "", "| shard | rows ok | rows failed | runtime s | load s | generate s | output tokens | tok/s | GPU util % |", "|---|---|---|---|---|---|---|---|---|"]
    for s in metrics["per_shard"]:
        st = s["stats"]
        cells = ["rows_processed", "rows_failed", "runtime_seconds", "model_load_seconds", "inference_runtime_seconds", "output_tokens", "tokens_per_sec", "gpu_util_mean"]
        lines.append(f"| {s['shard_id']} | " + " | ".join(_fmt(st.get(k)) for k in cells) + " |")
    return "\n".join(lines) + "\n"


def compute_metrics(state_dir: str | Path, num_shards: int, lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> dict:
    statuses, missing = load_statuses(state_dir, num_shards)
    states = shard_states(state_dir, num_shards, lease_timeout)
    per_shard = [
        {
            "shard_id": s["shard_id"],
            "hostname": s["hostname"],
            "attempt": s.get("attempt"),
            "started_at": s["started_at"],
            "finished_at": s["finished_at"],
            "gpu_name": (s.get("hardware") or {}).get("gpu_name"),
            "stats": s["stats"],
        }
        for s in statuses
    ]
    return {"per_shard": per_shard, "aggregate": aggregate(statuses, num_shards, missing, states)}


def write_report(state_dir: str | Path, num_shards: int, html: bool = True, lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> dict:
    metrics = compute_metrics(state_dir, num_shards, lease_timeout)
    atomic_write_json(Path(state_dir) / "metrics.json", metrics)
    atomic_write_text(Path(state_dir) / "summary.md", summary_markdown(metrics))
    if html:
        from mirageflow.report_html import render_html

        atomic_write_text(Path(state_dir) / "report.html", render_html(metrics, state_dir))
    return metrics
