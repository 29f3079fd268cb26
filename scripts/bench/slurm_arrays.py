"""Many small shards through profiles/slurm on the local test SLURM: sbatch calls and wall time.

    python scripts/bench/slurm_arrays.py [--shards 200 1000] [--rows-per-shard 2] [--no-arrays]

Each size in --shards is a run of its own, one after the other, in one invocation (the
growth from 200 to 1,000 shards side by side).

Runs the workflow (`python -m snakemake --profile profiles/slurm`) on the one-node SLURM of
tests/slurm_cluster.py (started when absent; needs root and slurm-wlm) with a cheap engine:
the `openai` backend against tests/fakes/fake_http.py's server in this process, so the
figures are the workflow's and the scheduler's, not a model's. The profile is used with
job arrays turned on as it documents (`--slurm-array-jobs shard --slurm-array-limit N
--max-jobs-per-timespan N/1s`, N = --array-limit; arrays are off by default) and otherwise
as is, except for what the test cluster needs: squeue instead of sacct (no slurmdbd) and
1-second polling. The benchmark's jobs run at the lowest SLURM priority (`--nice=1000000`, so a test's jobs on the same cluster go
first), each array capped at --throttle running tasks (`scontrol update ArrayTaskThrottle`)
and, with `nice -n 10` on the command, at a low CPU priority too (the cluster propagates it).
`--no-arrays` also runs the profile as is (one sbatch per shard, at most 10 a second) for
comparison.

Measured: successful sbatch submissions (the plugin's log: plain jobs and whole arrays),
wall time from the driver's start to its exit (report and merge written) and to the
aggregate (metrics.json written), the driver's CPU seconds and peak RSS (getrusage of the
finished child: the Snakemake process and the sbatch/squeue it ran; the RSS is the peak of
every driver so far, so run the sizes smallest first), whether every shard completed, and
what SLURM's accounting (metrics.json ``cluster_accounting``) says of the shard jobs. Prints ``name: value`` last and
writes its section of BENCHMARKS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import threading
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, now, write_section

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import slurm_cluster  # noqa: E402
from fakes.fake_http import FakeServer  # noqa: E402

SECTION = "slurm_arrays"


def throttle_arrays(run: slurm_cluster.Run, tasks: int) -> None:
    """Cap each array of ``run`` at ``tasks`` running tasks (`scontrol update ArrayTaskThrottle`,
    as docs/cluster.md advises), as soon as the driver logs its submission."""
    done: set[str] = set()
    while run.proc.poll() is None:
        for job_id in re.findall(r"^Submitted array job with Snakemake IDs \S+ and SLURM job ID (\d+)\.", run.output, re.MULTILINE):
            if job_id not in done:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", f"ArrayTaskThrottle={tasks}"], capture_output=True, timeout=30)
                done.add(job_id)
        time.sleep(0.5)


# snakemake-executor-plugin-slurm 2.8: an array's sbatch line holds every task's command
# (~1.6 kB each here); past the 128 KiB a single argument may have (E2BIG) the plugin
# retries through a /dev/stdin script that puts `--slurm-jobstep-array-execs` on a line
# of its own, so every task runs the array's first shard. Found by this benchmark at 200.
STDIN_FALLBACK = "Array sbatch command exceeds argument-length limits"


def run_once(root: Path, shards: int, rows_per_shard: int, arrays: bool, timeout: float, throttle: int = 0, array_limit: int = 40) -> dict:
    server = FakeServer().start()
    try:
        workdir = root / f"{'arrays' if arrays else 'plain'}-{shards}"
        workdir.mkdir()
        data = slurm_cluster.write_rows(workdir / "in.jsonl", shards * rows_per_shard)
        cfg = slurm_cluster.openai_pipeline(
            slurm_cluster.pipeline_config(
                # the lowest priority: a test's jobs on the same cluster go first
                Path("fake-model"),
                data,
                shards,
                gpus=0,
                mem="300M",
                time_limit="00:10:00",
                slurm_extra="--nice=1000000",
            ),
            server.url + "/v1",
            max_inflight=2,  # a few rows per shard: no point in more
        )
        extra = []  # one sbatch per shard: the profile as is
        if arrays:  # the opt-in that profiles/slurm documents: the chunk and the rate together
            extra = ["--slurm-array-jobs", "shard", "--slurm-array-limit", str(array_limit), "--max-jobs-per-timespan", f"{array_limit}/1s"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        node_before = slurm_cluster.node_cpu_seconds()
        t0, t0_epoch = time.monotonic(), time.time()
        run = slurm_cluster.Run(workdir, cfg, *extra, name="driver")
        if throttle:
            threading.Thread(target=throttle_arrays, args=(run, throttle), daemon=True).start()
        try:
            rc = run.wait(timeout)
        finally:
            run.stop()
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        node_after = slurm_cluster.node_cpu_seconds()
        metrics_path = workdir / "state" / "metrics.json"
        full = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        metrics = full.get("aggregate") or {}
        acct = full.get("cluster_accounting") or {}
        submissions = run.submissions()
        return {
            "arrays": arrays,
            "rc": rc,
            "shards": shards,
            "rows": shards * rows_per_shard,
            "sbatch_calls": len(submissions),
            "shard_sbatch_calls": len(submissions) - 1,  # one is the index job
            "wall_s": wall,
            "wall_to_aggregate_s": metrics_path.stat().st_mtime - t0_epoch if metrics_path.exists() else None,
            "driver_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "driver_peak_rss_mb": after.ru_maxrss / 1024,
            "node_cpu_s": None if node_before is None or node_after is None else node_after - node_before,
            "completed_shards": metrics.get("completed_shards"),
            "rows_processed": metrics.get("total_rows_processed"),
            "requests": len(server.records),
            "array_limit": array_limit if arrays else None,
            "stdin_fallback": STDIN_FALLBACK in run.output,
            "accounting": acct.get("source") or f"unavailable: {acct.get('reason')}",
            "accounting_states": (acct.get("totals") or {}).get("states"),
            "accounting_elapsed_s": (acct.get("totals") or {}).get("elapsed_seconds"),
            "accounting_cpu_efficiency": (acct.get("totals") or {}).get("cpu_efficiency"),
        }
    finally:
        server.stop()


def _submission(r: dict) -> str:
    if not r["arrays"]:
        return "one sbatch per shard (profile default)"
    how = f"job arrays of {r['array_limit']}"
    return how + (" **broken: stdin fallback**" if r["stdin_fallback"] else "")


def section(cmd: str, mach: dict, results: list[dict]) -> str:
    lines = [
        "## Many shards on SLURM: job arrays (`scripts/bench/slurm_arrays.py`)",
        "",
        f"`{cmd}` on {now()}, code {git_rev()}. Machine: {mach['nproc']} CPUs ({mach['cpu']}), Python "
        f"{mach['python']}, snakemake {mach['versions'].get('snakemake')}, snakemake-executor-plugin-slurm "
        f"{mach['versions'].get('snakemake-executor-plugin-slurm')}; load average at start {mach['loadavg_at_start']}.",
        "",
        "The one-node test SLURM of `tests/slurm_cluster.py` (16 CPUs declared on this machine, so tasks",
        "compete for its real CPUs), `profiles/slurm` with job arrays turned on as it documents (chunk and rate",
        "`--array-limit`; one sbatch per shard, the profile's default, in rows that say so), squeue status checks and 1-second polling;",
        "the jobs at the lowest SLURM priority and each array capped at `--throttle` running tasks (other work",
        "shared the machine and its test cluster: see the load average);",
        "engine: the `openai` backend against a fake server in the benchmark's process (no model). Wall time",
        "is from the driver's start to metrics.json written (aggregate) and to its exit (merged output written too);",
        "driver CPU and peak RSS are the Snakemake driver's (and the sbatch/squeue it ran; the RSS is the peak of",
        "every driver up to that row). Compute-node CPU is every job's CPU time, index job included (slurmd's cgroup,",
        "`slurm_cluster.node_cpu_seconds`). The job states are what `sacct` gave the report (`cluster_accounting`; this",
        "cluster keeps SLURM's job completion log, no slurmdbd).",
        "",
        "| submission | shards | rows | sbatch calls (shards + index) | wall s to aggregate | wall s | driver CPU s | driver peak RSS MB | compute-node CPU s (per shard) | completed | sacct: shard job states |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        to_agg = "n/a" if r["wall_to_aggregate_s"] is None else f"{r['wall_to_aggregate_s']:.0f}"
        node = "n/a" if r["node_cpu_s"] is None else f"{r['node_cpu_s']:.0f} ({r['node_cpu_s'] / r['shards']:.1f})"
        states = ", ".join(f"{k} {v}" for k, v in (r["accounting_states"] or {}).items()) or r["accounting"]
        lines.append(
            f"| {_submission(r)} | {r['shards']} | {r['rows']} | "
            f"{r['shard_sbatch_calls']} + 1 | {to_agg} | {r['wall_s']:.0f} | {r['driver_cpu_s']:.1f} | {r['driver_peak_rss_mb']:.0f} | {node} | "
            f"{r['completed_shards']}/{r['shards']} (rc {r['rc']}) | {states} |"
        )
    lines += [
        "",
        "Each array task starts Snakemake three times on the compute node (the plugin's array wrapper, the",
        "job step, the rule), a plain job twice: with shards of a few rows the wall time here is those starts",
        "on 2 real CPUs, not the scheduler. The sbatch count is what arrays change: one per chunk of shards.",
        "",
        "The plugin's default chunk of 1,000 does not work with snakemake-executor-plugin-slurm 2.8: an array's sbatch",
        "line carries every task's command (~1.6 kB each here), so past ~80 tasks it exceeds the 128 KiB a",
        "single argument may have (E2BIG); the plugin then retries through a /dev/stdin script that puts",
        "`--slurm-jobstep-array-execs` on a line of its own, and every task of the array runs its first shard",
        "(found here with 200 shards: all tasks ran shard 149, `--slurm-jobstep-array-execs: not found`). Rows",
        'marked "broken" hit that fallback; `--array-limit` measures a chunk that fits.',
    ]
    return "\n".join(lines) + "\n"


def figures(results: list[dict]) -> dict:
    out = {}
    for r in results:
        tag = f"slurm_{r['shards']}_shards" + ("" if r["arrays"] else "_no_arrays")
        out[f"{tag}_sbatch_calls"] = r["sbatch_calls"]
        out[f"{tag}_wall_s"] = round(r["wall_s"], 1)
        out[f"{tag}_wall_to_aggregate_s"] = None if r["wall_to_aggregate_s"] is None else round(r["wall_to_aggregate_s"], 1)
        out[f"{tag}_driver_cpu_s"] = round(r["driver_cpu_s"], 1)
        out[f"{tag}_driver_peak_rss_mb"] = round(r["driver_peak_rss_mb"])
        out[f"{tag}_node_cpu_s"] = None if r["node_cpu_s"] is None else round(r["node_cpu_s"], 1)
        out[f"{tag}_completed"] = r["completed_shards"]
        out[f"{tag}_sacct_completed_jobs"] = (r["accounting_states"] or {}).get("COMPLETED")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, nargs="+", default=[200, 1000], help="one run per size, in this order")
    ap.add_argument("--rows-per-shard", type=int, default=2)
    ap.add_argument("--no-arrays", action="store_true", help="also run with one sbatch per shard")
    ap.add_argument("--timeout", type=float, default=3 * 3600)
    ap.add_argument(
        "--array-limit", type=int, default=40,
        help="tasks per array (--slurm-array-limit and --max-jobs-per-timespan N/1s); default: the profile's documented 40",
    )  # fmt: skip
    ap.add_argument(
        "--throttle",
        type=int,
        default=8,
        help="running tasks per array at most (0: no cap); leaves the test cluster's other CPUs to others",
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = ap.parse_args()
    reason = slurm_cluster.unavailable_reason()
    if reason:
        sys.exit(reason)
    slurm_cluster.start()
    shown = [a for i, a in enumerate(sys.argv[1:]) if not (a.startswith("--workdir") or (i and sys.argv[i] == "--workdir"))]
    cmd = "python scripts/bench/slurm_arrays.py" + "".join(f" {shlex.quote(a)}" for a in shown)  # no path of this machine
    mach = machine("snakemake", "snakemake-executor-plugin-slurm")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-slurm-", dir=args.workdir) as tmp:
        for shards in args.shards:
            for arrays in [True] + ([False] if args.no_arrays else []):
                r = run_once(Path(tmp), shards, args.rows_per_shard, arrays, args.timeout, args.throttle, args.array_limit)
                print(f"[{'arrays' if arrays else 'plain'} {shards}] {json.dumps(r)}", file=sys.stderr, flush=True)
                results.append(r)
                if not args.no_write:  # after each size: a long run stopped later keeps what it measured
                    write_section(SECTION, section(cmd, mach, results))
    for k, v in figures(results).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
