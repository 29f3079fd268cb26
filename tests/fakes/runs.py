"""A run's on-disk state written by hand (status.json, failure.json, parts, gpu_samples.json), and
what the report embeds, read back; a shard job started as its own process (``start_shard_job``)."""

from __future__ import annotations

import base64
import json
import math
import random
import os
import re
import subprocess
import sys
from pathlib import Path

from mirageflow.data.writers import write_part
from mirageflow.files import atomic_write_json
from mirageflow.stats import formulas as stats

GPU = "NVIDIA H100 80GB HBM3"
REPO = Path(__file__).resolve().parents[2]

SHARD_JOB = """
import sys
from mirageflow.config import load_config
from mirageflow.shard.runner import run_shard
run_shard(load_config(sys.argv[1]), int(sys.argv[2]))
"""


def start_shard_job(root: Path, raw: dict, shard: int) -> subprocess.Popen:
    """Shard ``shard`` of the config ``raw`` (written to root/pipeline_<shard>.yaml) run in a
    process of its own, as a job runs it (without Snakemake), output merged into a text pipe."""
    import yaml

    path = root / f"pipeline_{shard}.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.Popen([sys.executable, "-c", SHARD_JOB, str(path), str(shard)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def make_state(root: Path, num_shards: int = 6, gpu_samples: bool = True, seed: int = 1) -> Path:
    """A finished-looking GPU run, by hand: shard 4 a straggler, the last shard failed."""
    rng = random.Random(seed)
    state = root / "state"
    for shard in range(num_shards - 1):
        runtime = 1800.0 if shard == 4 else 600.0 + 20 * shard
        load, gen = 60.0, runtime - 80.0
        hist = stats.TokenHistogram()
        for _ in range(500):
            hist.add(int(rng.lognormvariate(5.3, 0.5)))
        util = max(0.0, 92.0 - 3 * shard)  # a utilisation: 0..100 %
        hist = hist.to_json()  # its sum is counted when it is read
        status = {
            "shard_id": shard, "num_shards": num_shards, "status": "success", "attempt": 1,
            "hostname": f"gpu{shard:03d}", "started_at": f"2025-03-01T10:{shard:02d}:00+00:00",
            "finished_at": f"2025-03-01T{10 + int((shard * 60 + runtime) // 3600):02d}:{int((shard * 60 + runtime) % 3600 // 60):02d}:00+00:00",
            "hardware": {"gpu_name": GPU, "driver_version": "570.86.15"},
            "stats": {
                "runtime_seconds": runtime, "model_load_seconds": load, "warmup_seconds": 5.0,
                "generation_seconds": gen, "inference_runtime_seconds": gen - 2, "write_seconds": 3.0,
                "engine_idle_seconds": 4.0, "rows_processed": 500, "rows_failed": shard % 3,
                "rows_failed_by_class": {"json_parse": shard % 3} if shard % 3 else {},
                "input_tokens": 500 * 300, "output_tokens": hist["sum"], "num_gpus": 2,
                "tokens_per_sec": hist["sum"] / (gen - 2),
                "tokens_per_sec_per_gpu": hist["sum"] / (gen - 2) / 2,
                "gpu_util_mean": util, "gpu_util_min": 0.0, "gpu_util_max": 100.0, "gpu_util_samples": 2 * int(gen / 0.5),
                "gpu_sampled_seconds": gen, "gpu_energy_joules": 700.0 * 2 * gen,
                "gpus": [{"index": i, "uuid": f"GPU-{shard}-{i}", "name": GPU, "util_mean": util} for i in range(2)],
                "roofline_tokens_per_sec_per_gpu": 400.0,
                "output_tokens_per_row_hist": hist,
            },
        }  # fmt: skip
        atomic_write_json(state / f"shard_{shard}" / "status.json", status)
        if gpu_samples:
            n = 120
            t = [gen * i / n for i in range(n)]
            series = [
                [max(0.0, min(100.0, util + 6 * math.sin(i / 7 + g) - (40 if i in (30, 31, 80) else 0))) for i in range(n)]
                for g in range(2)
            ]
            atomic_write_json(state / f"shard_{shard}" / "gpu_samples.json", {
                "shard_id": shard, "started_at": f"2025-03-01T10:{shard:02d}:{int(load):02d}+00:00"
                if load < 60 else f"2025-03-01T10:{shard + 1:02d}:00+00:00",
                "interval_seconds": 0.5, "gpus": [{"index": g, "uuid": f"GPU-{shard}-{g}", "name": GPU} for g in range(2)],
                "t": t, "duration": [gen / n] * n, "util": series, "memory_used_mb": [[70000.0] * n] * 2,
            })  # fmt: skip
    atomic_write_json(state / f"shard_{num_shards - 1}" / "failure.json", {
        "shard_id": num_shards - 1, "status": "failed", "attempt": 3, "hostname": "gpu099", "slurm_job_id": "77",
        "error": "EngineCrashed: the SGLang server exited with status -9 (out of memory?)", "signal": None,
    })  # fmt: skip
    return state


def finish_shard(cfg, ds, shard_id: int, rows: list[dict], status: str = "success", num_shards: int | None = None, per_part: int = 2):
    """A shard's parts and its status.json, as the runner leaves them (parts listed, records counted)."""
    out = Path(ds.output_dir) / f"shard_{shard_id}"
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for n, start in enumerate(range(0, len(rows), per_part)):
        names.append(f"part-{n:05d}.{ds.output_format}")
        write_part(out / names[-1], rows[start : start + per_part], ds.output_format)
    status_doc = {
        "status": status,
        "num_shards": cfg.num_shards if num_shards is None else num_shards,
        "started_at": "2025-01-01T10:00:00+00:00",
        "finished_at": "2025-01-01T10:01:00+00:00",
        "stats": {"runtime_seconds": 60.0, "inference_runtime_seconds": 50.0, "output_tokens": 0, "num_gpus": 0},
        "datasets": [
            {"parts": names, "rows_processed": len(rows)} if d.index == ds.index else {"parts": [], "rows_processed": 0}
            for d in cfg.datasets
        ],
    }
    atomic_write_json(cfg.shard_dir(shard_id) / "status.json", status_doc)


def row_errors(cfg, shard: int = 0) -> list[dict]:
    """The records of a shard's errors.jsonl."""
    return [json.loads(line) for line in (cfg.shard_dir(shard) / "errors.jsonl").read_text().splitlines()]


def report_images(page: str) -> list[bytes]:
    """The SVG figures embedded in report.html, decoded."""
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', page)]


def merged_rows(root: Path, out: str = "out") -> list[dict]:
    return [json.loads(line) for p in sorted((root / out / "merged").glob("*.jsonl")) for line in p.read_text().splitlines()]


def files_on_disk(root: Path) -> dict:
    """Every file and directory under root (but Snakemake's own .snakemake/) with its mtime and size."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(".snakemake") or rel == "pipeline.yaml":  # Snakemake's own; the config the helper writes
            continue
        st = p.lstat()
        out[rel] = (st.st_mtime_ns, st.st_size)
    return out


def mark_incomplete(root: Path, path: str) -> None:
    """Snakemake's own marker that a job writing ``path`` started and was never seen to end (its
    file persistence: ``.snakemake/incomplete/<urlsafe base64 of the path>``), as a driver stopped
    while the job finished leaves it."""
    marker = root / ".snakemake" / "incomplete" / base64.urlsafe_b64encode(path.encode()).decode()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"external_jobid": None}))
