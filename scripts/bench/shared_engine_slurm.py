"""Per-shard fixed cost on the local test SLURM: one engine per shard vs 8 shards sharing one.

    python scripts/bench/shared_engine_slurm.py [--shards 8] [--rows-per-shard 2] [--no-write]

The SLURM side of scripts/bench/shared_engine.py (same tiny model, config and shards),
through `profiles/slurm` on the one-node SLURM of tests/slurm_cluster.py (started when
absent; needs root and slurm-wlm):

1. unshared: ``shards_per_engine: 1``: one plain job per shard, one at a time (``--jobs 1
   --slurm-array-jobs none``, as ``--cores 1`` runs them locally: side by side on this
   2-CPU machine each job's elapsed time would mostly be waiting for a CPU), each job
   loading the model. (An array task starts Snakemake once more than a plain job.)
2. shared_8: ``shards_per_engine: 8``: one group job holds the engine service and its 8
   shards.

What a cluster bills is allocation time, so the fixed cost of a shard here is the
allocation time outside generation, per shard: unshared, the sum over the shard jobs of
(the job's elapsed time - its generation_seconds) / shards; shared, (the group job's elapsed
time - its longest shard's generation_seconds) / shards. Elapsed times are SLURM's
(``cluster_accounting`` in metrics.json, whole seconds). The driver's wall time, start to
exit, is printed too. Figures are printed last as ``name: value``; the section
``shared_engine_slurm`` of BENCHMARKS.md is rewritten unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, machine, machine_lines, now, print_figures, write_jsonl, write_section
from shared_engine import K, _config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import slurm_cluster  # noqa: E402


def run_mode(root: Path, model: Path, k: int, shards: int, rows_per_shard: int, tag: str) -> dict:
    d = root / tag
    d.mkdir()
    write_jsonl(d / "in.jsonl", [{"title": f"Title number {i}"} for i in range(shards * rows_per_shard)])
    cfg = _config(model, shards, shards * rows_per_shard, k)
    cfg["execution_params"].update(partition="cpu", cpus_per_task=1, mem="1G", time_limit="00:30:00")
    t0 = time.monotonic()
    run = slurm_cluster.Run(d, cfg, *(["--slurm-array-jobs", "none", "--jobs", "1"] if k == 1 else []), name="driver")
    try:
        rc = run.wait(3600)
    finally:
        run.stop()
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"{tag}: snakemake failed (rc {rc}):\n{run.output[-4000:]}")
    metrics = json.loads((d / "state" / "metrics.json").read_text())
    acct = metrics.get("cluster_accounting") or {}
    if not acct.get("available"):
        raise SystemExit(f"{tag}: no SLURM accounting in metrics.json: {acct.get('reason')}")
    gens = {}
    for i in range(shards):
        status = json.loads((d / "state" / f"shard_{i}" / "status.json").read_text())
        gens[i] = status["stats"]["generation_seconds"]
    elapsed = {j["job_id"]: j["elapsed_seconds"] for j in acct["jobs"]}
    if k == 1:
        fixed = sum(j["elapsed_seconds"] - gens[j["shard_id"]] for j in acct["jobs"]) / shards
    else:
        fixed = (sum(elapsed.values()) - max(gens.values())) / shards
    return {
        "wall_s": wall,
        "shard_jobs": len(elapsed),
        "allocation_s": sum(elapsed.values()),
        "generation_s": sum(gens.values()) if k == 1 else max(gens.values()),
        "fixed_per_shard_s": fixed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=K)
    ap.add_argument("--rows-per-shard", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    reason = slurm_cluster.unavailable_reason()
    if reason:
        raise SystemExit(f"no test SLURM: {reason}")
    slurm_cluster.start()
    info = machine("snakemake", "snakemake-executor-plugin-slurm", "torch", "transformers")
    started = now()
    with tempfile.TemporaryDirectory(prefix="bench-shared-engine-slurm-") as tmp:
        root = Path(tmp)
        model = root / "tiny-llama"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
        u = run_mode(root, model, 1, args.shards, args.rows_per_shard, "unshared")
        print(f"unshared: {json.dumps({k: round(v, 2) for k, v in u.items()})}", flush=True)
        s = run_mode(root, model, K, args.shards, args.rows_per_shard, "shared_8")
        print(f"shared_8: {json.dumps({k: round(v, 2) for k, v in s.items()})}", flush=True)
    if not args.no_write:
        cmd = "python scripts/bench/shared_engine_slurm.py"
        rows = [
            f"| {name} | {m['shard_jobs']} | {m['wall_s']:.0f} | {m['allocation_s']:.0f} | {m['generation_s']:.2f} | **{m['fixed_per_shard_s']:.1f}** |"
            for name, m in (("1 shard per engine (plain jobs, 1 at a time)", u), (f"{K} shards share an engine (one group job)", s))
        ]
        body = f"""## Shared engine on the test SLURM: per-shard fixed cost (allocation time outside generation)

Command: `{cmd}` (commit {git_rev()}, {started}; load average {info["loadavg_at_start"]} at start).

{machine_lines(info)}
The tiny test model through `profiles/slurm` on the one-node SLURM of `tests/slurm_cluster.py` (2 real CPUs), the
pipeline of `shared_engine.py`: {args.shards} shards of {args.rows_per_shard} rows, max_new_tokens 1. Fixed cost per shard =
allocation time outside generation / shards: unshared, the sum of (job elapsed - generation) over the shard jobs;
shared, the group job's elapsed - its longest generation. Elapsed times are SLURM's (whole seconds).

| mode | SLURM jobs | driver wall s | allocation s | generation s | fixed cost per shard s |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Shared, a shard costs {s["fixed_per_shard_s"] / u["fixed_per_shard_s"]:.2f} of the unshared allocation time outside generation
(target: at most 0.25). An unshared SLURM shard also pays the plugin's Snakemake starts inside its job (two per
plain job, three per array task); in the group job they are paid once for the engine and its {K} shards.
"""
        write_section("shared_engine_slurm", body)
    print_figures({
        "slurm_wall_s_unshared": u["wall_s"],
        "slurm_wall_s_shared_8": s["wall_s"],
        "slurm_fixed_cost_per_shard_s_unshared": u["fixed_per_shard_s"],
        "slurm_fixed_cost_per_shard_s_shared_8": s["fixed_per_shard_s"],
    })  # fmt: skip


if __name__ == "__main__":
    main()
