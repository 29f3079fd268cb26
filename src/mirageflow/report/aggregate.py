"""Aggregate every shard's state into metrics.json, a Markdown summary and report.html.

A shard is ``done`` (status.json with status success), ``running`` (progress.json or
lease.json updated recently), ``failed`` (failure.json, or a progress.json that stopped
updating mid-run: the job was killed) or ``pending`` (nothing yet). The aggregate has
MMIRAGE's keys plus our additions; ``README.md`` ("Numbers in the report") defines them.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from mirageflow.stats import formulas as stats
from mirageflow.files import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

STRAGGLER_FACTOR = 1.5  # a shard slower than 1.5 x the median runtime
PROGRESS_STALE_SECONDS = 120.0  # progress.json is rewritten every 5 s while a shard lives
DEFAULT_LEASE_TIMEOUT = 300.0


# --------------------------------------------------------------------------- reading the state files
#
# Every state file is read through read_state_file: one that does not parse or has the wrong
# shape is "damaged", named in a one-line warning and in the report, never a crash. A damaged
# status.json never counts as done (the shard is failed, with the reason), and write_report
# raises after writing the report, so the aggregate rule fails instead of claiming success.


class DamagedStateError(ValueError):
    """A shard's status.json exists but is damaged: the run is not complete, whatever Snakemake thinks."""


def _is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_numbers(d: dict, keys, prefix: str = "", required: bool = False) -> str | None:
    for k in keys:
        v = d.get(k)
        if v is None and not required:
            continue
        if not _is_num(v):
            return f"{prefix}{k} is {'missing' if k not in d else _show(v)}, not a number"
    return None


def _check_strings(d: dict, keys, prefix: str = "") -> str | None:
    for k in keys:
        if d.get(k) is not None and not isinstance(d[k], str):
            return f"{prefix}{k} is {_show(d[k])}, not a string"
    return None


def _check_time(d: dict, key: str) -> str | None:
    v = d.get(key)
    try:
        if isinstance(v, str) and stats.parse_time(v).tzinfo is not None:
            return None
    except ValueError:
        pass
    return f"{key} is {'missing' if key not in d else _show(v)}, not a timestamp with a UTC offset"


def _check_hist(h) -> bool:
    if h is None:
        return True
    if not isinstance(h, dict) or not isinstance(h.get("buckets"), list):
        return False
    if not all(isinstance(b, list) and len(b) == 3 and all(_is_num(x) for x in b) for b in h["buckets"]):
        return False
    return _is_num(h.get("rows")) and _is_num(h.get("sum")) and all(h.get(k) is None or _is_num(h[k]) for k in ("min", "max"))


# stats keys the report does arithmetic on: each a number or null when present
STATS_NUMBERS = (
    "runtime_seconds", "inference_runtime_seconds", "output_tokens", "num_gpus", "rows_processed", "rows_failed",
    "rows_filtered", "input_tokens", "model_load_seconds", "warmup_seconds", "generation_seconds", "write_seconds",
    "engine_idle_seconds", "gpu_util_mean", "gpu_sampled_seconds", "gpu_energy_joules", "roofline_tokens_per_sec_per_gpu",
)  # fmt: skip
# ... and those a successful shard's figures cannot do without
STATS_REQUIRED = ("runtime_seconds", "inference_runtime_seconds", "output_tokens", "num_gpus")


def check_stats(st, required: tuple = ()) -> str | None:
    """Why a ``stats`` dict (status.json or failure.json) cannot be used, or None."""
    if not isinstance(st, dict):
        return f"stats is {_show(st)}, not an object"
    why = _check_numbers(st, required, "stats.", required=True) or _check_numbers(st, STATS_NUMBERS, "stats.")
    if why:
        return why
    by_class = st.get("rows_failed_by_class")
    if by_class is not None and not (isinstance(by_class, dict) and all(_is_num(v) for v in by_class.values())):
        return "stats.rows_failed_by_class is not an object of counts"
    gpus = st.get("gpus")
    if gpus is not None and not (isinstance(gpus, list) and all(isinstance(g, dict) and (g.get("util_mean") is None or _is_num(g["util_mean"])) for g in gpus)):
        return "stats.gpus is not a list of GPU objects"
    if not _check_hist(st.get("output_tokens_per_row_hist")):
        return "stats.output_tokens_per_row_hist is not a token histogram"
    attempts = st.get("attempts")
    if attempts is not None and not (isinstance(attempts, list) and all(isinstance(a, dict) for a in attempts)):
        return "stats.attempts is not a list of attempt objects"
    return None


def check_status(status: dict, shard_id: int | None = None) -> str | None:
    """Why a status.json cannot be used, or None. Only a successful one needs its stats and times."""
    if not isinstance(status.get("status"), str):
        return f"status is {'missing' if 'status' not in status else _show(status['status'])}, not a string"
    if status.get("shard_id") is not None and shard_id is not None and status["shard_id"] != shard_id:
        return f"shard_id is {_show(status['shard_id'])}, not {shard_id}"
    if status.get("num_shards") is not None and not (isinstance(status["num_shards"], int) and not isinstance(status["num_shards"], bool)):
        return f"num_shards is {_show(status['num_shards'])}, not an integer"
    if status["status"] != "success":
        return None
    return (
        _check_time(status, "started_at") or _check_time(status, "finished_at")
        or _check_strings(status, ("hostname",))
        or (None if status.get("hardware") is None or isinstance(status["hardware"], dict) else "hardware is not an object")
        or check_stats(status.get("stats"), STATS_REQUIRED)
    )  # fmt: skip


def check_failure(failure: dict) -> str | None:
    if not isinstance(failure.get("error"), str):
        return f"error is {'missing' if 'error' not in failure else _show(failure['error'])}, not a string"
    why = _check_strings(failure, ("signal", "hostname", "finished_at"))
    if why:
        return why
    return None if failure.get("stats") is None else check_stats(failure["stats"])


def check_lease(lease: dict) -> str | None:
    return _check_numbers(lease, ("heartbeat",), required=True) or _check_strings(lease, ("hostname",))


def read_state_file(path: str | Path, check=None) -> tuple[dict | None, str | None]:
    """(content, None); (None, None) when the file is absent; (None, why) when it is damaged.

    Damaged: unreadable, not JSON, not a JSON object, or ``check(content)`` says why not.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read it ({e.strerror or e})"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError: random bytes
        return None, f"not JSON ({str(e).splitlines()[0][:80]})" if raw.strip() else "empty file"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__ if not isinstance(data, list) else 'array'}, not an object"
    why = check(data) if check is not None else None
    return (None, why) if why else (data, None)


# what the report and `mmirage status` make of a damaged file
DAMAGED_CONSEQUENCE = {
    "status.json": "the shard is not counted as done (failed); delete the file and rerun the shard (mmirage retry)",
    "failure.json": "the shard counts as failed, without its error and stats",
    "progress.json": "ignored (the shard's state comes from its other files)",
    "lease.json": "ignored (the shard's state comes from its other files)",
    "gpu_samples.json": "ignored (no GPU timeline for the shard)",
}


def damaged_note(path: str | Path, why: str) -> str:
    return f"damaged state file {path}: {why}"


def load_statuses(state_dir: str | Path, num_shards: int) -> tuple[list[dict], list[int]]:
    """Successful shards' status.json contents, and the ids of shards without one (or with a damaged one)."""
    found, missing = [], []
    for shard_id in range(num_shards):
        path = Path(state_dir) / f"shard_{shard_id}" / "status.json"
        status, why = read_state_file(path, lambda s: check_status(s, shard_id))
        if status is None:
            if why:
                log.warning("%s; shard %d is not counted as done", damaged_note(path, why), shard_id)
            missing.append(shard_id)
            continue
        _check_num_shards(status, path, num_shards)
        if status.get("status") == "success":
            found.append({"shard_id": shard_id, **status})
        else:
            missing.append(shard_id)
    return found, missing


def _check_num_shards(status: dict, path: Path, num_shards: int) -> None:
    if status.get("num_shards", num_shards) != num_shards:
        raise ValueError(
            f"{path} comes from a run with num_shards={status['num_shards']}, the config says {num_shards}; "
            "use a fresh state_dir (and output_dir) when changing num_shards"
        )


def attempts_count(stats_: dict | None) -> int | None:
    """How many attempts a shard's stats cover: the length of ``stats.attempts``; None in older files without it."""
    attempts = (stats_ or {}).get("attempts")
    return len(attempts) if isinstance(attempts, list) else None


def shard_states(
    state_dir: str | Path, num_shards: int, lease_timeout: float = DEFAULT_LEASE_TIMEOUT, now: float | None = None
) -> list[dict]:
    """One entry per shard: ``state`` (done | running | failed | pending) and what its files say.

    Works from the files alone (on a login node or locally): a running shard rewrites
    progress.json every few seconds and heartbeats lease.json; a failed one left
    failure.json (error, signal) or a progress.json that stopped updating mid-run.
    Damaged files are listed in the entry's ``damaged`` ([{file, path, reason}], only when
    there are any) and otherwise ignored, except a damaged status.json or failure.json: the
    shard is failed with ``error`` "damaged state file <path>: <why>" (unless it runs now).
    ``failure`` holds a failed shard's failure.json (its ``stats`` count in the report).
    """
    from mirageflow.shard.progress import check_progress

    now = time.time() if now is None else now
    out = []
    for shard_id in range(num_shards):
        d = Path(state_dir) / f"shard_{shard_id}"
        damaged = []

        def read(name, check):
            data, why = read_state_file(d / name, check)
            if why:
                damaged.append({"file": name, "path": str(d / name), "reason": why})
            return data

        status = read("status.json", lambda s: check_status(s, shard_id))
        failure = read("failure.json", check_failure)
        progress = read("progress.json", check_progress)
        lease = read("lease.json", check_lease)
        bad = {x["file"]: x for x in damaged}
        entry = {"shard_id": shard_id, "state": "pending", "progress": progress}
        lease_age = now - lease["heartbeat"] if lease and lease.get("heartbeat") is not None else None
        progress_age = now - progress["updated_at_unix"] if progress and progress.get("updated_at_unix") is not None else None
        progress_live = progress is not None and progress.get("phase") not in ("done", "failed") and progress_age is not None
        if "progress.json" in bad and progress_age is None:  # a damaged progress.json still says when it was written
            try:
                progress_age = now - (d / "progress.json").stat().st_mtime
            except OSError:
                pass
            progress_live = progress_age is not None and status is None
        if status is not None and status.get("num_shards", num_shards) != num_shards:
            entry["other_run_num_shards"] = status["num_shards"]
        if status is not None and status.get("status") == "success" and status.get("num_shards", num_shards) == num_shards:
            entry.update(state="done", status=status)
        elif (lease_age is not None and lease_age < lease_timeout) or (progress_live and progress_age < PROGRESS_STALE_SECONDS):
            entry.update(state="running", since_update_seconds=progress_age if progress_live else lease_age)
            entry["host"] = (progress or lease or {}).get("hostname")
            entry["slurm_job_id"] = (progress or lease or {}).get("slurm_job_id")
        elif "status.json" in bad or (failure is None and "failure.json" in bad):
            x = bad.get("status.json") or bad["failure.json"]
            more = "not counted as done; delete it and rerun the shard (mmirage retry)" if x["file"] == "status.json" else "the shard failed"
            entry.update(
                state="failed", error=f"{damaged_note(x['path'], x['reason'])}; {more}", signal=None,
                attempt=(progress or {}).get("attempt"), host=(progress or lease or {}).get("hostname"),
                slurm_job_id=(progress or lease or {}).get("slurm_job_id"), finished_at=None,
            )  # fmt: skip
            if failure is not None:
                entry["failure"] = failure
        elif failure is not None:
            entry.update(
                state="failed", error=failure.get("error"), signal=failure.get("signal"), attempt=failure.get("attempt"),
                host=failure.get("hostname"), slurm_job_id=failure.get("slurm_job_id"), finished_at=failure.get("finished_at"),
                failure=failure,
            )  # fmt: skip
        elif progress_live:  # stopped updating without failure.json: SIGKILL, OOM killer, node failure
            p = progress or {}
            if progress is None:  # damaged
                x = bad["progress.json"]
                error = (f"{damaged_note(x['path'], x['reason'])}; no status.json or failure.json: stopped (killed?); "
                         f"progress.json last written {stats.human_duration(progress_age)} ago")  # fmt: skip
            else:
                error = (f"stopped without a failure record in phase '{p.get('phase')}' (killed?); "
                         f"progress.json last updated {stats.human_duration(progress_age)} ago")  # fmt: skip
            entry.update(
                state="failed", signal=None, attempt=p.get("attempt"), host=p.get("hostname") or (lease or {}).get("hostname"),
                slurm_job_id=p.get("slurm_job_id"), finished_at=p.get("updated_at"), error=error,
            )  # fmt: skip
        if damaged:
            entry["damaged"] = damaged
        out.append(entry)
    return out


# which shards each figure of the aggregate covers (also in metrics.json, as "figure_scope")
FIGURE_SCOPE = {
    "completed and failed shards": "total_rows_failed, rows_failed_by_class (a failed shard's rows from its failure.json); "
    "split into rows_failed_completed_shards and rows_failed_failed_shards",
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
    if mean == 0:  # no shard holds a GPU (a CPU run): there are no GPU-hours to project
        return None
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
    failed = []
    for s in by_state["failed"]:
        fst = (s.get("failure") or {}).get("stats") or {}  # totals over the shard's attempts, when failure.json has them
        failed.append(
            {k: s.get(k) for k in ("shard_id", "error", "signal", "attempt", "host", "slurm_job_id", "finished_at")}
            | {k: fst.get(k) for k in ("rows_processed", "rows_failed")}
            | {"rows_failed_by_class": fst.get("rows_failed_by_class"), "attempts": attempts_count(fst)}
        )
    # energy and roofline over the shards that know them
    energy = [s for s in statuses if s["stats"].get("gpu_energy_joules") is not None]
    energy_j = sum(s["stats"]["gpu_energy_joules"] for s in energy) if energy else None
    energy_tokens = sum(s["stats"]["output_tokens"] for s in energy)
    roof = [s for s in statuses if s["stats"].get("roofline_tokens_per_sec_per_gpu")]
    roof_capacity = sum(
        s["stats"]["roofline_tokens_per_sec_per_gpu"] * s["stats"]["num_gpus"] * s["stats"]["inference_runtime_seconds"] for s in roof
    )
    # failed rows over every shard that says (completed ones, and failed ones through failure.json's stats)
    failed_by_class: dict[str, int] = {}
    for by_class in [s["stats"].get("rows_failed_by_class") for s in statuses] + [f["rows_failed_by_class"] for f in failed]:
        for k, v in (by_class or {}).items():
            failed_by_class[k] = failed_by_class.get(k, 0) + v
    rows_failed_done = int(_sum(statuses, "rows_failed"))
    rows_failed_failed = int(sum(f["rows_failed"] or 0 for f in failed))
    hardware = [s.get("hardware") or {} for s in statuses]
    return {
        "total_shards": num_shards,
        "completed_shards": len(statuses),
        "missing_shards": missing,
        "running_shards": [s["shard_id"] for s in by_state["running"]],
        "pending_shards": [s["shard_id"] for s in by_state["pending"]],
        "failed_shards": failed,
        "total_rows_processed": rows,
        "total_rows_failed": rows_failed_done + rows_failed_failed,
        "total_rows_filtered": int(_sum(statuses, "rows_filtered")),  # dropped by filter steps (completed shards)
        "rows_failed_by_class": failed_by_class,
        "rows_failed_completed_shards": rows_failed_done,
        "rows_failed_failed_shards": rows_failed_failed,
        "rows_processed_failed_shards": int(sum(f["rows_processed"] or 0 for f in failed)),
        "figure_scope": FIGURE_SCOPE,
        "damaged_state_files": [
            {"shard_id": s["shard_id"], **x} for s in states or [] for x in s.get("damaged") or []
        ],
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
        "gpu_names": sorted({str(h["gpu_name"]) for h in hardware if h.get("gpu_name")}),
        "driver_versions": sorted({str(h["driver_version"]) for h in hardware if h.get("driver_version")}),
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
_NOT_IN_TABLE = {
    "missing_shards", "running_shards", "pending_shards", "failed_shards", "stragglers", "output_tokens_per_row_hist",
    "rows_failed_by_class", "figure_scope", "damaged_state_files",
}  # fmt: skip


# the row counts' meaning, beside their keys (summary.md; report.html has its own labels)
ROW_LABELS = {
    "total_rows_processed": "rows ok",
    "total_rows_failed": "rows failed",
    "total_rows_filtered": "rows filtered (a filter step's predicate was false; not errors)",
    "rows_processed_failed_shards": "rows ok in failed shards",
}


def scope_sentence(agg: dict) -> str:
    """Which shards the figures cover, in one sentence (summary.md and report.html)."""
    failed = agg.get("failed_shards") or []
    if not failed and not agg.get("total_rows_failed"):  # nothing failed: say so, not "0 in 0 failed shard(s)"
        if not agg["completed_shards"]:
            return "No shard has completed or failed yet."
        return f"No row and no shard failed; the figures cover the {agg['completed_shards']} completed shard(s)."
    text = (
        f"Failed rows (total_rows_failed, rows_failed_by_class) count completed and failed shards: "
        f"{_fmt(agg.get('rows_failed_completed_shards'))} in completed shards, "
        f"{_fmt(agg.get('rows_failed_failed_shards'))} in {len(failed)} failed shard(s)"
    )
    if failed:
        text += f" (which also committed {_fmt(agg.get('rows_processed_failed_shards'))} rows ok)"
    return text + f"; every other figure covers the {agg['completed_shards']} completed shard(s) only."


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
    if agg.get("damaged_state_files"):
        lines += ["## Damaged state files", ""]
        lines += [f"- {_cell(damaged_note(x['path'], x['reason']))}; {DAMAGED_CONSEQUENCE.get(x['file'], 'ignored')}" for x in agg["damaged_state_files"]]
        lines.append("")
    lines += ["| metric | value | what |", "|---|---|---|"]
    for k, v in agg.items():
        if k in _NOT_IN_TABLE or (k.endswith("_human") and k[: -len("_human")] + "_seconds" in agg):
            continue  # a *_human figure is shown beside its *_seconds twin
        twin = k[: -len("_seconds")] + "_human" if k.endswith("_seconds") else None
        shown = f"{_fmt(v)} s ({agg[twin]})" if twin in agg and _is_num(v) else _fmt(v)
        lines.append(f"| `{k}` | {shown} | {ROW_LABELS.get(k, '')} |")
    if agg.get("rows_failed_by_class"):
        lines += ["", "Failed rows by error class (completed and failed shards): "
                  + ", ".join(f"{_cell(k)} {v:,}" for k, v in sorted(agg["rows_failed_by_class"].items(), key=lambda kv: -kv[1]))]  # fmt: skip
    if agg.get("failed_shards"):
        lines += ["", "## Failed shards", "", "| shard | error | signal | host | attempts | rows ok | rows failed |", "|---|---|---|---|---|---|---|"]
        for f in agg["failed_shards"]:
            error = _cell(f.get("error"))[:300]
            lines.append(
                f"| {f['shard_id']} | {error} | {_cell(f.get('signal'))} | {_cell(f.get('host'))} | "
                f"{_fmt(f.get('attempts'))} | {_fmt(f.get('rows_processed'))} | {_fmt(f.get('rows_failed'))} |"
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
                f"| {_cell(d.get('dataset'))} | `{_cell(d.get('text_field'))}` | {_fmt(d.get('rows_in'))} | {_fmt(d.get('exact_duplicates_removed'))} | "
                f"{_fmt(d.get('near_duplicates_removed'))} | {_fmt(d.get('rows_out'))} | {_fmt(d.get('rows_without_text'))} |"
            )
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
        lines.append(f"| {s['shard_id']} | {_fmt(s.get('attempts'))} | " + " | ".join(_fmt(st.get(k)) for k in cells) + " |")
    return "\n".join(lines) + "\n"


def compute_metrics(state_dir: str | Path, num_shards: int, lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> dict:
    states = shard_states(state_dir, num_shards, lease_timeout)
    for s in states:
        if s.get("other_run_num_shards") is not None:  # a status.json of another run refuses the report
            _check_num_shards({"num_shards": s["other_run_num_shards"]}, Path(state_dir) / f"shard_{s['shard_id']}" / "status.json", num_shards)
        for x in s.get("damaged") or []:
            log.warning("%s; %s", damaged_note(x["path"], x["reason"]), DAMAGED_CONSEQUENCE[x["file"]])
    statuses = [{**s["status"], "shard_id": s["shard_id"]} for s in states if s["state"] == "done"]
    missing = [s["shard_id"] for s in states if s["state"] != "done"]
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
            "stats": s["stats"],
        }
        for s in statuses
    ]
    agg = aggregate(statuses, num_shards, missing, states)
    from mirageflow.cluster.engine_service import shared_engine_summary  # shards_per_engine > 1: count each load once

    agg["shared_engines"] = shared_engine_summary(state_dir, statuses)
    if agg["shared_engines"]:
        agg["sum_model_load_seconds"] = agg["shared_engines"]["sum_model_load_seconds_attributed"]
    return {"per_shard": per_shard, "aggregate": agg}


def full_metrics(state_dir: str | Path, num_shards: int, lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> dict:
    """What metrics.json holds (the aggregate and `mmirage stats`): compute_metrics, plus
    the SLURM accounting and the dedup counts. Only here, not in compute_metrics: `mmirage
    status` must not wait on sacct."""
    from mirageflow.data.dedup import read_dedup_counts
    from mirageflow.report.slurm_accounting import cluster_accounting

    metrics = compute_metrics(state_dir, num_shards, lease_timeout)
    metrics["cluster_accounting"] = cluster_accounting(metrics)
    metrics["deduplication"] = read_dedup_counts(state_dir)  # [] unless deduplication_params.enabled
    return metrics


def write_report(state_dir: str | Path, num_shards: int, html: bool = True, lease_timeout: float = DEFAULT_LEASE_TIMEOUT) -> dict:
    """Write metrics.json, summary.md and report.html (atomically, through data.writers).

    Raises DamagedStateError after writing them when a shard's status.json is damaged: the
    file exists, so Snakemake took the shard for done, but it is not; the aggregate rule fails.
    """
    metrics = full_metrics(state_dir, num_shards, lease_timeout)
    atomic_write_json(Path(state_dir) / "metrics.json", metrics)
    atomic_write_text(Path(state_dir) / "summary.md", summary_markdown(metrics))
    if html:
        from mirageflow.report.html import render_html

        atomic_write_text(Path(state_dir) / "report.html", render_html(metrics, state_dir))
    bad = [x for x in metrics["aggregate"]["damaged_state_files"] if x["file"] == "status.json"]
    if bad:
        raise DamagedStateError(
            "; ".join(damaged_note(x["path"], x["reason"]) for x in bad)
            + f" -- shard(s) {[x['shard_id'] for x in bad]} not done: delete the damaged status.json and rerun "
            "(mmirage retry); the report lists them as failed"
        )
    return metrics
