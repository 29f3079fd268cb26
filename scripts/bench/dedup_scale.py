"""Dedup at scale (issue 37): the stages as parallel jobs (data/dedup_stages.py) against the
single job they replace, on the same merged output and the same cores.

    python scripts/bench/dedup_scale.py --rows 200000 --compare-src /path/to/old/src
    python scripts/bench/dedup_scale.py --rows 20000 --no-write        # a quick look

A merged JSONL output of ``--rows`` records of ~600 B of random words (``text``, as
data_scale.py's ``question``) in 200 parts (one per shard): 80% originals, 10% exact copies
(other case and spacing), 10% near copies (one word replaced), each after its original.
Defaults: exact + fuzzy, threshold 0.85, 128 permutations, 5-char shingles; 200 shards, so
``dedup_partitions`` = 25 jobs per stage. Every job runs in its own process (a stage's jobs
``--cores`` at a time); each reports wall, CPU (user + sys) and peak RSS (``VmHWM``, imports
included). ``--compare-src``: the same dataset through that copy of src/ (the single job:
``mirageflow.data.dedup.dedup_dataset`` before the stages), and its removed list must be the
stages' byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "tests"))  # fakes: the run's config and shards, as the tests make them
import _common as C

SHARDS = 200
PARAMS = {"enabled": True, "exact": True, "fuzzy": True, "text_field": "text", "threshold": 0.85, "num_perm": 128, "shingle_size": 5}


def _lines(rows: int) -> list[bytes]:
    """The records, in source order, as JSONL lines (module docstring)."""
    rng = random.Random(rows)
    vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 10))) for _ in range(20_000)]
    n_orig = int(rows * 0.8)
    keyed = [(float(j), " ".join(rng.choices(vocab, k=85))) for j in range(n_orig)]
    for i in range(rows - n_orig):
        j = rng.randrange(n_orig)
        src = keyed[j][1]
        if i % 2 == 0:
            text = "  " + src.upper().replace(" ", "  ") + "\n"
        else:
            words = src.split()
            words[rng.randrange(len(words))] = "zebra"
            text = " ".join(words)
        keyed.append((rng.uniform(j + 0.5, n_orig), text))
    keyed.sort(key=lambda kv: kv[0])
    return [(json.dumps({"id": k, "text": t, "source_index": k}) + "\n").encode() for k, (_, t) in enumerate(keyed)]


def shard_run_config(root: Path):
    """The pipeline config of the workspace as a run of SHARDS shards (JSONL out), for the merge."""
    from fakes.configs import pipeline_config

    from mirageflow.config import load_config

    raw = pipeline_config(
        root / "in.jsonl", state_dir=root / "state", output_dir=root / "out", num_shards=SHARDS,
        dataset={"output_format": "jsonl"}, processor={"backend": "openai", "base_url": "http://127.0.0.1:9/v1"},
    )  # fmt: skip
    return load_config(raw, check_paths=False)


def build(root: Path, rows: int, shards: bool = False) -> None:
    """The workspace of ``rows`` records in SHARDS parts: merged/ and its manifest (the dedup's
    input), or (``shards``) each shard's part and status.json as a finished run leaves them
    (the merge's input: tests/fakes/runs.py's finish_shard)."""
    from mirageflow.data.writers import write_merged

    lines = _lines(rows)
    per = -(-rows // SHARDS)
    if shards:
        from fakes.runs import finish_shard

        cfg = shard_run_config(root)
        for shard in range(SHARDS):
            records = [json.loads(x) for x in lines[shard * per : (shard + 1) * per]]
            finish_shard(cfg, cfg.datasets[0], shard, records, per_part=max(1, len(records)))
        return
    write_merged((lines[i : i + per] for i in range(0, rows, per)), root / "out" / "merged", "jsonl")
    (root / "state" / "merged").mkdir(parents=True, exist_ok=True)
    (root / "state" / "merged" / "dataset_0.json").write_text(json.dumps({"rows": rows}))


def stage_jobs(n: int) -> list[tuple[str, int]]:
    """(step, jobs) of the dedup stages in order, with n jobs a parallel stage (the workflow's rules)."""
    return [("signatures", n), ("pairs", n), ("decide", 1), ("write", n), ("finish", 1)]


def child(step: str, root: str, k: str) -> dict:
    """One job: ``single`` (the old code, BENCH_OLD_SRC first on sys.path), ``signatures`` k,
    ``pairs`` k, ``decide``, ``write`` k (its parts of deduplicated/), ``finish`` (the last
    stage: deduplicated/ in place, the removed list)."""
    if step == "single":
        sys.path.insert(0, os.environ["BENCH_OLD_SRC"])
    from mirageflow.config.types import DedupParams

    t0, c0, r0 = time.perf_counter(), os.times(), C.bytes_read()
    root_p = Path(root)
    cfg = SimpleNamespace(state_dir=str(root_p / "state"), num_shards=SHARDS)
    ds = SimpleNamespace(index=0, path="synthetic", output_dir=str(root_p / "out"), output_format="jsonl")
    params = DedupParams(**PARAMS)
    state = root_p / "state"
    if step == "single":
        from mirageflow.data.dedup import dedup_dataset as single

        single(cfg, ds, params, state / "old.json", state / "old.removed.jsonl")
    elif step == "merge":  # the merge rule's job: the shards' parts -> merged/ and its manifest
        from mirageflow.data.merge import merge_dataset
        from mirageflow.files import atomic_write_json
        from mirageflow.state.layout import StateLayout

        run = shard_run_config(root_p)
        atomic_write_json(StateLayout(run.state_dir).merge_manifest(0), merge_dataset(run, run.datasets[0]))
    else:
        from mirageflow.data import dedup_stages as stages
        from mirageflow.data.dedup import dedup_partitions
        from mirageflow.state.layout import StateLayout

        n, paths = dedup_partitions(cfg), StateLayout(cfg.state_dir)
        files = [paths.dedup_signatures(0, j) for j in range(n)]
        if step == "signatures":
            stages.write_signatures(root_p / "out" / "merged", "jsonl", params, n, int(k), files[int(k)])
        elif step == "pairs":
            stages.write_pairs(params, n, int(k), files, paths.dedup_edges(0, int(k)))
        elif step == "decide":
            stages.write_decisions(cfg, ds, params, n)
        elif step == "write":
            stages.write_kept(cfg, ds, params, n, int(k))
        else:
            stages.write_deduplicated(cfg, ds, params, n, state / "new.json", state / "new.removed.jsonl")
    c1, r1 = os.times(), C.bytes_read()
    return {
        "wall": time.perf_counter() - t0,
        "cpu": (c1.user - c0.user) + (c1.system - c0.system),
        "rchar": r1[0] - r0[0],
        "rss_mb": C.peak_rss_mb(),
    }


def run_job(step: str, root: Path, k: int = 0, old_src: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if old_src:
        env["BENCH_OLD_SRC"] = old_src
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", step, str(root), str(k)], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{step} {k} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall"] = time.perf_counter() - t0
    return out


def stage(step: str, root: Path, jobs: int, cores: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cores) as pool:
        results = list(pool.map(lambda k: run_job(step, root, k), range(jobs)))
    return {
        "jobs": jobs,
        "wall": time.perf_counter() - t0,
        "cpu": sum(r["cpu"] for r in results),
        "rchar": sum(r["rchar"] for r in results),
        "max_rss_mb": max(r["rss_mb"] for r in results),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        return
    from mirageflow.data.dedup import dedup_partitions

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compare-src", help="the src/ of the single-job dedup (the code before the stages)")
    ap.add_argument("--tmp", help="folder for the dataset (default: a temp dir, removed at the end)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    cmd = f"python scripts/bench/dedup_scale.py --rows {args.rows} --cores {args.cores}"
    if args.compare_src:
        cmd += " --compare-src <src before the stages>"
    info = C.machine("mirageflow", "datasketch", "numpy")
    n = dedup_partitions(SimpleNamespace(num_shards=SHARDS))
    rows_out = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        build(root, args.rows)
        print(f"built {args.rows:,} rows in {time.perf_counter() - t:.0f} s", flush=True)
        stages = {}
        for step, jobs in stage_jobs(n):
            stages[step] = stage(step, root, jobs, args.cores)
            print(step, stages[step], flush=True)
        new = json.loads((root / "state" / "new.json").read_text())
        total = {"wall": sum(s["wall"] for s in stages.values()), "cpu": sum(s["cpu"] for s in stages.values())}
        for step, s in stages.items():
            rows_out.append([f"stages: {step}", s["jobs"], C.fmt(s["wall"], 1), C.fmt(s["cpu"], 1), C.fmt(s["max_rss_mb"])])
        rows_out.append(
            [
                "stages: all",
                3 * n + 2,
                C.fmt(total["wall"], 1),
                C.fmt(total["cpu"], 1),
                C.fmt(max(s["max_rss_mb"] for s in stages.values())),
            ]
        )
        same = None
        if args.compare_src:
            old = run_job("single", root, old_src=args.compare_src)
            print("single", old, flush=True)
            rows_out.append(["single job (before)", 1, C.fmt(old["wall"], 1), C.fmt(old["cpu"], 1), C.fmt(old["rss_mb"])])
            same = (root / "state" / "old.removed.jsonl").read_bytes() == (root / "state" / "new.removed.jsonl").read_bytes()
    body = f"""## Dedup at scale: stages as parallel jobs vs the single job (`scripts/bench/dedup_scale.py`)

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{args.rows:,} merged JSONL records (~600 B of random words) in {SHARDS} parts: 80% originals, 10% exact
copies, 10% near copies; exact + fuzzy at the defaults (threshold 0.85, 128 permutations).
{n} jobs per parallel stage (`dedup_partitions` for {SHARDS} shards), {args.cores} at a time; every job
its own process. Wall: the stage's, jobs {args.cores} at a time; CPU: its jobs' sum (user +
sys); peak RSS: the largest job's (`VmHWM`, imports included). Removed {new["exact_duplicates_removed"]:,} exact and
{new["near_duplicates_removed"]:,} near duplicates{"" if same is None else ("; the single job's removed list is the same, byte for byte" if same else "; THE SINGLE JOB'S REMOVED LIST DIFFERS")}.
The machine is shared: wall times are noisy, CPU and RSS less so.

{C.table(["job", "jobs", "wall s", "CPU s", "peak RSS MB (largest job)"], rows_out)}
"""
    if not args.no_write:
        C.write_section(f"dedup_scale_{args.rows}", body)
    print(body)


if __name__ == "__main__":
    main()
