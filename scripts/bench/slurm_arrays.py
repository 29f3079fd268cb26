"""Many small shards through profiles/slurm on the local test SLURM: sbatch calls and wall time.

    python scripts/bench/slurm_arrays.py [--shards 200] [--rows-per-shard 3] [--no-arrays]

Runs the workflow (`python -m snakemake --profile profiles/slurm`) on the one-node SLURM of
tests/slurm_cluster.py (started when absent; needs root and slurm-wlm) with a cheap engine:
the `openai` backend against tests/fakes/fake_http.py's server in this process, so the
figures are the workflow's and the scheduler's, not a model's. The profile is used as is
(job arrays, no job cap, submission rate = array chunk) except for what the test cluster
needs: squeue instead of sacct (no slurmdbd) and 1-second polling. `--no-arrays` runs the
same with one sbatch per shard (`--slurm-array-jobs none --jobs 1000
--max-jobs-per-timespan 100/1s`) for comparison.

Measured: successful sbatch submissions (the plugin's log: plain jobs and whole arrays),
wall time from the driver's start to its exit (report and merge written), the driver's
CPU seconds and peak RSS (getrusage of the finished child: the Snakemake process and the
sbatch/squeue it ran), and whether every shard completed. Prints ``name: value`` last and
writes its section of BENCHMARKS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, now, write_section  # noqa: E402 - sibling module of this script

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import slurm_cluster  # noqa: E402
from fakes.fake_http import FakeServer  # noqa: E402

SECTION = "slurm_arrays"


def run_once(root: Path, shards: int, rows_per_shard: int, arrays: bool, timeout: float) -> dict:
    server = FakeServer().start()
    try:
        workdir = root / ("arrays" if arrays else "plain")
        workdir.mkdir()
        data = slurm_cluster.write_rows(workdir / "in.jsonl", shards * rows_per_shard)
        cfg = slurm_cluster.openai_pipeline(
            slurm_cluster.pipeline_config(Path("fake-model"), data, shards, gpus=0, mem="300M", time_limit="00:10:00"),
            server.url + "/v1",
        )
        extra = [] if arrays else ["--slurm-array-jobs", "none", "--jobs", "1000", "--max-jobs-per-timespan", "100/1s"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        run = slurm_cluster.Run(workdir, cfg, *extra, name="driver")
        try:
            rc = run.wait(timeout)
        finally:
            run.stop()
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        metrics = json.loads((workdir / "state" / "metrics.json").read_text())["aggregate"] if rc == 0 else {}
        submissions = run.submissions()
        return {
            "arrays": arrays,
            "rc": rc,
            "shards": shards,
            "rows": shards * rows_per_shard,
            "sbatch_calls": len(submissions),
            "shard_sbatch_calls": len(submissions) - 1,  # one is the index job
            "wall_s": wall,
            "driver_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "driver_peak_rss_mb": after.ru_maxrss / 1024,
            "completed_shards": metrics.get("completed_shards"),
            "rows_processed": metrics.get("total_rows_processed"),
            "requests": len(server.records),
        }
    finally:
        server.stop()


def section(cmd: str, mach: dict, results: list[dict]) -> str:
    lines = [
        "## Many shards on SLURM: job arrays (`scripts/bench/slurm_arrays.py`)",
        "",
        f"`{cmd}` on {now()}, code {git_rev()}. Machine: {mach['nproc']} CPUs ({mach['cpu']}), Python "
        f"{mach['python']}, snakemake {mach['versions'].get('snakemake')}, snakemake-executor-plugin-slurm "
        f"{mach['versions'].get('snakemake-executor-plugin-slurm')}; load average at start {mach['loadavg_at_start']}.",
        "",
        "The one-node test SLURM of `tests/slurm_cluster.py` (16 CPUs declared on this machine, so tasks",
        "compete for its real CPUs), `profiles/slurm` as is except squeue status checks and 1-second polling;",
        "engine: the `openai` backend against a fake server in the benchmark's process (no model). Wall time",
        "is from the driver's start to its exit (report and merged output written); driver CPU and peak RSS",
        "are the Snakemake driver's (and the sbatch/squeue it ran).",
        "",
        "| submission | shards | rows | sbatch calls (shards + index) | wall s | driver CPU s | driver peak RSS MB | completed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {'job arrays (profile default)' if r['arrays'] else 'one sbatch per shard'} | {r['shards']} | {r['rows']} | "
            f"{r['shard_sbatch_calls']} + 1 | {r['wall_s']:.0f} | {r['driver_cpu_s']:.1f} | {r['driver_peak_rss_mb']:.0f} | "
            f"{r['completed_shards']}/{r['shards']} (rc {r['rc']}) |"
        )
    lines += [
        "",
        "Each array task starts Snakemake three times on the compute node (the plugin's array wrapper, the",
        "job step, the rule), a plain job twice: with shards of a few rows the wall time here is those starts",
        "on 2 real CPUs, not the scheduler. The sbatch count is what arrays change: one per 1,000 shards.",
    ]
    return "\n".join(lines) + "\n"


def figures(results: list[dict]) -> dict:
    out = {}
    for r in results:
        tag = f"slurm_{r['shards']}_shards" + ("" if r["arrays"] else "_no_arrays")
        out[f"{tag}_sbatch_calls"] = r["sbatch_calls"]
        out[f"{tag}_wall_s"] = round(r["wall_s"], 1)
        out[f"{tag}_driver_cpu_s"] = round(r["driver_cpu_s"], 1)
        out[f"{tag}_driver_peak_rss_mb"] = round(r["driver_peak_rss_mb"])
        out[f"{tag}_completed"] = r["completed_shards"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--rows-per-shard", type=int, default=3)
    ap.add_argument("--no-arrays", action="store_true", help="also run with one sbatch per shard")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = ap.parse_args()
    reason = slurm_cluster.unavailable_reason()
    if reason:
        sys.exit(reason)
    slurm_cluster.start()
    cmd = "python scripts/bench/slurm_arrays.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    mach = machine("snakemake", "snakemake-executor-plugin-slurm")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-slurm-", dir=args.workdir) as tmp:
        for arrays in [True] + ([False] if args.no_arrays else []):
            r = run_once(Path(tmp), args.shards, args.rows_per_shard, arrays, args.timeout)
            print(f"[{'arrays' if arrays else 'plain'}] {json.dumps(r)}", file=sys.stderr)
            results.append(r)
    if not args.no_write:
        write_section(SECTION, section(cmd, mach, results))
    for k, v in figures(results).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
