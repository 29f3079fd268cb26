"""Aggregate every shard's status.json into metrics.json and a short Markdown summary."""

from __future__ import annotations

import json
from pathlib import Path

from mirageflow import stats
from mirageflow.data.writers import atomic_write_json, atomic_write_text


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


def _sum(shards: list[dict], key: str) -> float:
    return sum(s["stats"].get(key) or 0 for s in shards)


def aggregate(statuses: list[dict], num_shards: int, missing: list[int]) -> dict:
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
    return {
        "total_shards": num_shards,
        "completed_shards": len(statuses),
        "missing_shards": missing,
        "total_rows_processed": rows,
        "total_rows_failed": int(_sum(statuses, "rows_failed")),
        "wall_clock_runtime_seconds": wall,
        "wall_clock_runtime_human": stats.human_duration(wall),
        "sum_shard_runtime_seconds": sum(runtimes),
        "sum_shard_runtime_human": stats.human_duration(sum(runtimes)),
        "min_shard_runtime_seconds": min(runtimes, default=None),
        "min_shard_runtime_human": stats.human_duration(min(runtimes, default=None)),
        "max_shard_runtime_seconds": max(runtimes, default=None),
        "max_shard_runtime_human": stats.human_duration(max(runtimes, default=None)),
        "overall_throughput_rows_per_sec": rows / wall if wall else None,
        "mean_gpu_util_pct": None,  # needs GPU sampling (stats: true), which lands with NVML support
        "num_gpus": max((s["stats"]["num_gpus"] for s in statuses), default=0),
        "total_input_tokens": int(_sum(statuses, "input_tokens")),
        "total_output_tokens": out_tokens,
        "sum_model_load_seconds": _sum(statuses, "model_load_seconds"),
        "sum_inference_runtime_seconds": inference,
        "tokens_per_sec": out_tokens / inference if inference > 0 else None,
        "tokens_per_sec_per_gpu": out_tokens / gpu_gen_seconds if gpu_gen_seconds > 0 else None,
        "gpu_days_per_billion_tokens": (
            gpu_gen_seconds / stats.SECONDS_PER_DAY / (out_tokens / 1e9) if gpu_gen_seconds > 0 and out_tokens else None
        ),
        "gpu_hours_allocated": gpu_alloc_seconds / 3600,
        "tokens_per_sec_per_gpu_allocated": out_tokens / gpu_alloc_seconds if gpu_alloc_seconds > 0 else None,
        "gpu_days_per_billion_tokens_allocated": (
            gpu_alloc_seconds / stats.SECONDS_PER_DAY / (out_tokens / 1e9) if gpu_alloc_seconds > 0 and out_tokens else None
        ),
    }


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


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
    lines += [f"| `{k}` | {_fmt(v)} |" for k, v in agg.items() if k != "missing_shards"]
    lines += ["", "## Shards", "", "| shard | rows ok | rows failed | runtime s | load s | generate s | output tokens | tok/s |", "|---|---|---|---|---|---|---|---|"]
    for s in metrics["per_shard"]:
        st = s["stats"]
        cells = ["rows_processed", "rows_failed", "runtime_seconds", "model_load_seconds", "inference_runtime_seconds", "output_tokens", "tokens_per_sec"]
        lines.append(f"| {s['shard_id']} | " + " | ".join(_fmt(st.get(k)) for k in cells) + " |")
    return "\n".join(lines) + "\n"


def compute_metrics(state_dir: str | Path, num_shards: int) -> dict:
    statuses, missing = load_statuses(state_dir, num_shards)
    per_shard = [{"shard_id": s["shard_id"], "hostname": s["hostname"], "started_at": s["started_at"], "finished_at": s["finished_at"], "stats": s["stats"]} for s in statuses]
    return {"per_shard": per_shard, "aggregate": aggregate(statuses, num_shards, missing)}


def write_report(state_dir: str | Path, num_shards: int) -> dict:
    metrics = compute_metrics(state_dir, num_shards)
    atomic_write_json(Path(state_dir) / "metrics.json", metrics)
    atomic_write_text(Path(state_dir) / "summary.md", summary_markdown(metrics))
    return metrics
