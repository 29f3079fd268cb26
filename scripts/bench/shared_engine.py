"""Per-shard fixed cost with one engine per shard vs one engine shared by 8 shards.

    python scripts/bench/shared_engine.py                # writes the shared_engine section of BENCHMARKS.md
    python scripts/bench/shared_engine.py --no-write
    python scripts/bench/shared_engine.py --load-seconds 90 --paper-shards 1000

The fixed cost of a shard is its wall time outside generation: Snakemake's scheduling, a
fresh Python process, imports, config validation, the model load (or, shared, the wait
for the engine's), the commits and status.json. Measured on the tiny test model
(scripts/make_tiny_model.py), locally, with --shards shards of --rows-per-shard rows each
and max_new_tokens 1, so generation is a few tens of ms:

1. unshared: ``shards_per_engine: 1``, ``--cores 1``: the shards run one after another,
   each loading the model (what every shard paid before).
2. shared_8: ``shards_per_engine: 8``, ``--cores 1``: one engine job loads the model once
   and its 8 shards run beside it (a Snakemake service and its consumers; a served shard
   holds no core in Snakemake's count).

In each mode the dataset is indexed first (not timed); then ``snakemake <the shards'
status.json>`` is timed from start to exit (wall W, Snakemake's own start and DAG
included once). Fixed cost per shard = (W - G) / shards, where G is the generation time:
the sum of the shards' generation_seconds when they run one after another, the longest
one when they run side by side. Runs alternate between the modes (--repeats); figures
are medians.

On paper: the GPU-hours spent loading models for --paper-shards shards of Qwen3-4B on an
H200, with and without sharing, for an assumed load time (--load-seconds, 90 s: no GPU
here to measure it). scripts/gpu_check.sh measures it on the GPU machine (its
``model_load_seconds``: a shard's load phase of a model in Qwen3-4B's shape from local
disk, with ``gpu_hours_loading_1000_shards_*`` computed from it); rerun this with
``--load-seconds`` set to that figure. Printed last, one per line, ``name: value``.
"""

from __future__ import annotations

from _common import git_rev, machine, machine_lines, now, print_figures, transformers_processor, write_jsonl, write_section

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K = 8


def _config(model: Path, shards: int, rows: int, k: int) -> dict:
    return {
        "processors": [transformers_processor(model, 1)],
        "loading_params": {
            "state_dir": "state",
            "datasets": [{"path": "in.jsonl", "type": "JSONL", "output_dir": "out", "output_format": "jsonl"}],
            "num_shards": shards,
            "batch_size": 4,
        },
        "processing_params": {
            "inputs": [{"name": "title", "key": "title"}],
            "outputs": [{"name": "headline", "type": "llm", "output_type": "plain", "prompt": "Headline: {{ title }}"}],
        },
        "execution_params": {"shards_per_engine": k, "merge": False},
    }


def _snakemake(workdir: Path, cores: int, *targets: str) -> float:
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
        "--configfile", str(workdir / "pipeline.yaml"), "--cores", str(cores), *targets, "--quiet", "all",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed in {workdir}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return took


def run_mode(root: Path, model: Path, k: int, shards: int, rows_per_shard: int, tag: str) -> dict:
    d = root / tag
    d.mkdir()
    write_jsonl(d / "in.jsonl", [{"title": f"Title number {i}"} for i in range(shards * rows_per_shard)])
    (d / "pipeline.yaml").write_text(yaml.safe_dump(_config(model, shards, shards * rows_per_shard, k), sort_keys=False))
    cores = 1
    _snakemake(d, cores, "state/datasets/dataset_0.index.json")  # not timed
    wall = _snakemake(d, cores, *[f"state/shard_{i}/status.json" for i in range(shards)])
    statuses = [json.loads((d / "state" / f"shard_{i}" / "status.json").read_text()) for i in range(shards)]
    gens = [s["stats"]["generation_seconds"] for s in statuses]
    gen = sum(gens) if k == 1 else max(gens)
    loads = []
    for f in (d / "state" / "engines").glob("*.stats.json"):
        loads += json.loads(f.read_text())["loads"]
    shard_load = statistics.median(s["stats"]["model_load_seconds"] for s in statuses)
    return {
        "wall_s": wall,
        "generation_s": gen,
        "fixed_per_shard_s": (wall - gen) / shards,
        "engine_loads": len(loads) if k > 1 else shards,
        "engine_load_s": statistics.median(x["model_load_seconds"] for x in loads) if loads else shard_load,
        "shard_load_phase_s": shard_load,  # unshared: the shard's own load; shared: its wait for the engine
        "rows": sum(s["stats"]["rows_processed"] for s in statuses),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=K, help="shards per run (one engine group of 8 when shared)")
    ap.add_argument("--rows-per-shard", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--load-seconds", type=float, default=90.0, help="assumed Qwen3-4B load time on an H200 (paper figure)")
    ap.add_argument("--paper-shards", type=int, default=1000)
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    info = machine("snakemake", "torch", "transformers")
    started = now()
    runs: dict[str, list[dict]] = {"unshared": [], "shared_8": []}
    with tempfile.TemporaryDirectory(prefix="bench-shared-engine-") as tmp:
        root = Path(tmp)
        model = root / "tiny-llama"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
        for r in range(args.repeats):
            for mode, k in (("unshared", 1), ("shared_8", K)):
                res = run_mode(root, model, k, args.shards, args.rows_per_shard, f"{mode}-{r}")
                runs[mode].append(res)
                print(f"{mode} run {r + 1}: {json.dumps({k: round(v, 3) for k, v in res.items()})}", flush=True)
    med = {m: {key: statistics.median(x[key] for x in rs) for key in rs[0]} for m, rs in runs.items()}
    u, s = med["unshared"], med["shared_8"]
    groups = -(-args.paper_shards // K)
    gpu_h_unshared = args.paper_shards * args.load_seconds / 3600
    gpu_h_shared = groups * args.load_seconds / 3600
    try:
        load_end = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load_end = "?"
    if not args.no_write:
        cmd = "python scripts/bench/shared_engine.py" + (f" --repeats {args.repeats}" if args.repeats != 1 else "")
        rows = [
            [name, f"{args.shards}", f"{m['engine_loads']:.0f}", f"{m['wall_s']:.1f}", f"{m['generation_s']:.2f}",
             f"{m['engine_load_s']:.2f}", f"{m['shard_load_phase_s']:.2f}", f"**{m['fixed_per_shard_s']:.2f}**"]
            for name, m in (("1 shard per engine (`--cores 1`)", u), (f"{K} shards share an engine (`--cores 1`)", s))
        ]  # fmt: skip
        body = f"""## Shared engine: per-shard fixed cost with and without one engine for 8 shards

Command: `{cmd}` (commit {git_rev()}, {started}; load average {info["loadavg_at_start"]} at start, {load_end} at end: a shared
2-CPU machine, so wall times include waiting for the CPU).

{machine_lines(info)}
Tiny test model, local runs, {args.shards} shards of {args.rows_per_shard} rows, max_new_tokens 1. Wall = `snakemake <the
shards' status.json>` from start to exit, the dataset already indexed; fixed cost per shard = (wall - generation) /
shards, generation = the sum of the shards' generation_seconds (one after another) or the longest (side by side).
Medians of {args.repeats} run(s) per mode, modes alternating.

| mode | shards | model loads | wall s | generation s | one load s | shard's load phase s (shared: its wait) | fixed cost per shard s |
|---|---|---|---|---|---|---|---|
{chr(10).join("| " + " | ".join(r) + " |" for r in rows)}

Sharing cuts the per-shard fixed cost {u["fixed_per_shard_s"] / s["fixed_per_shard_s"]:.1f}x: shared it is
{s["fixed_per_shard_s"] / u["fixed_per_shard_s"]:.2f} of the unshared cost measured in the same conditions (target: at most
0.25). The target in seconds, a quarter of the 9.4 s measured on a quieter machine (section snakemake_scale: 2.0 s of
job overhead + 7.3 s of load), is 2.35 s: {"met" if s["fixed_per_shard_s"] <= 2.35 else "not met in this run"} ({s["fixed_per_shard_s"]:.2f} s,
with one load taking {s["engine_load_s"]:.1f} s here instead of about 7 s). What is left per shard is its share of the one load
and its own process (Python, imports without torch, config validation, checkpoint, status.json) next to Snakemake's scheduling.

On paper, {args.paper_shards:,} shards of Qwen3-4B on H200s, assuming {args.load_seconds:.0f} s per model load (not
measured: no GPU here): one engine per shard loads {args.paper_shards:,} times, **{gpu_h_unshared:.1f} GPU-hours** of
loading; {K} shards per engine load {groups:,} times, **{gpu_h_shared:.2f} GPU-hours**.
"""
        write_section("shared_engine", body)
    print_figures({
        "wall_s_unshared": u["wall_s"],
        "wall_s_shared_8": s["wall_s"],
        "model_loads_unshared": u["engine_loads"],
        "model_loads_shared_8": s["engine_loads"],
        "assumed_qwen3_4b_h200_load_s": args.load_seconds,
        f"gpu_hours_loading_{args.paper_shards}_shards_unshared": gpu_h_unshared,
        f"gpu_hours_loading_{args.paper_shards}_shards_shared_8": gpu_h_shared,
        "fixed_cost_per_shard_s_unshared": u["fixed_per_shard_s"],
        "fixed_cost_per_shard_s_shared_8": s["fixed_per_shard_s"],
    })  # fmt: skip


if __name__ == "__main__":
    main()
