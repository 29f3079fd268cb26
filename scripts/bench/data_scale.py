"""Data at scale (issue 37): what indexing a dataset, reading a late shard, the merge and the
dedup cost at 200k and 2M rows, and how each grows with 10x the rows.

    python scripts/bench/data_scale.py                       # 200k and 2M rows: ~15-30 min on a busy machine
    python scripts/bench/data_scale.py --sizes 20000 200000  # a quick look
    python scripts/bench/data_scale.py --compare-src /path/to/other/src   # also the smallest size with other code

Datasets (~1 KB a row: ``id``, ``question`` ~600 B, ``context`` ~400 B of random words)
under a temp dir: JSONL, Parquet in 10,000-row groups, and Parquet in ONE row group (what
``pyarrow.parquet.write_table`` writes up to 1Mi rows). Each step runs in its own process
(``--child``), which reports its wall time, CPU time (user + sys), bytes read
(``rchar`` of ``/proc/self/io``: every read, page cache or not) and peak RSS
(``VmHWM``, imports included; the bare process with pyarrow imported is reported too).

Steps, with ``num_shards`` 200:
- ``index``: ``write_index`` (the index job);
- ``late shard``: ``load_shard`` + every row of shard 190 (``read_shard``) with the columns
  a pipeline reading ``question`` uses; for the one-group file also with every column
  (``remove_columns: false``);
- ``shard job``: shard 190 through the shard runner (``run_shard``, an instant engine
  without a tokenizer, a pipeline reading ``question``), its index made first in the same
  process and the peak RSS cleared before the measure;
- ``touch: driver``: after ``os.utime`` (same bytes), the driver's content check at DAG build
  (``state.inputs.dataset_changed``, then the content cache saved);
- ``touch: job``: then a shard job's ``load_shard`` (it trusts the driver's record);
- on dedup_scale.py's workspace (its records, ~600 B of text, 10% exact and 10% near
  copies, as the 200 shards' parts and status files a finished run leaves: its builder):
  ``merge`` (the merge rule's job, ``merge_dataset``), then each dedup stage, its jobs
  ``--cores`` at a time (dedup_scale.py's ``stage``: wall of the stage, CPU and bytes read
  summed over its jobs, the largest job's peak RSS), and all stages together.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

SHARDS = 200
LATE = 190
CHUNK = 50_000
GROUP_ROWS = 10_000
KINDS = ("jsonl", "parquet", "parquet-1rg")


# --------------------------------------------------------------------------- datasets


def _texts(rng: random.Random, vocab: list[str], n: int, words: int) -> list[str]:
    return [" ".join(rng.choices(vocab, k=words)) for _ in range(n)]


def build(root: Path, rows: int) -> dict[str, Path]:
    """The three datasets of ``rows`` rows under ``root`` (JSONL, 10k-row groups, one group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": root / "data.jsonl", "parquet": root / "data.parquet", "parquet-1rg": root / "one_group.parquet"}
    rng = random.Random(rows)
    vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 10))) for _ in range(20_000)]
    chunks = []
    writer = None
    with open(paths["jsonl"], "w", encoding="utf-8") as jsonl:
        for start in range(0, rows, CHUNK):
            n = min(CHUNK, rows - start)
            table = pa.table(
                {"id": list(range(start, start + n)), "question": _texts(rng, vocab, n, 85), "context": _texts(rng, vocab, n, 57)}
            )
            jsonl.writelines(json.dumps(r) + "\n" for r in table.to_pylist())
            if writer is None:
                writer = pq.ParquetWriter(paths["parquet"], table.schema)
            writer.write_table(table, row_group_size=GROUP_ROWS)
            chunks.append(table)
    writer.close()
    whole = pa.concat_tables(chunks)
    del chunks
    pq.write_table(whole, paths["parquet-1rg"], row_group_size=rows)
    assert pq.ParquetFile(paths["parquet-1rg"]).metadata.num_row_groups == 1
    return paths


# --------------------------------------------------------------------------- one step, in its own process


def child(step: str, kind: str, path: str, state: str) -> dict:
    import pyarrow.parquet  # noqa: F401 - imported before the measure, as a job has it

    from mirageflow.config import DatasetConfig
    from mirageflow.data import readers

    ds = DatasetConfig(
        index=0, path=path, type="jsonl" if kind == "jsonl" else "parquet", output_dir="unused", output_format="parquet", split=None
    )
    index = Path(state) / "dataset_0.index.json"
    if step == "shard job":  # its own index first (the index job's), then the peak is cleared
        _job_config(kind, path, Path(state), index_only=True)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
    base_rss = C.peak_rss_mb()
    r0, c0, t0 = C.bytes_read(), os.times(), time.perf_counter()
    rows = None
    if step == "index":
        rows = readers.write_index(ds, SHARDS, index)["rows"]
    elif step in ("late shard", "late shard, all columns"):
        piece = readers.load_shard(index, ds, SHARDS, LATE)
        columns = None if step.endswith("all columns") else frozenset({"question"})
        try:
            it = readers.read_shard(ds, piece, columns=columns)
        except TypeError:  # code from before columns (--compare-src): every column
            it = readers.read_shard(ds, piece)
        rows = sum(1 for _ in it)
    elif step == "touch: driver":
        from mirageflow.state.inputs import ContentCache, dataset_changed

        cache = ContentCache(Path(state) / "content.json")
        assert dataset_changed(ds, cache, index) is None
        cache.save()
    elif step == "shard job":
        rows = _shard_job(kind, path, Path(state))
    elif step == "touch: job":
        piece = readers.load_shard(index, ds, SHARDS, LATE)
        rows = piece.stop - piece.start
    else:
        raise SystemExit(f"unknown step {step}")
    t1, c1, r1 = time.perf_counter(), os.times(), C.bytes_read()
    return {
        "wall": t1 - t0,
        "cpu": (c1.user - c0.user) + (c1.system - c0.system),
        "rchar": r1[0] - r0[0],
        "disk": r1[1] - r0[1],
        "rss_mb": C.peak_rss_mb(),
        "base_rss_mb": base_rss,
        "rows": rows,
    }


def _job_config(kind: str, path: str, state: Path, index_only: bool = False):
    """A pipeline reading ``question`` (remove_columns: true) over the dataset, 200 shards."""
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets

    from pipeline_overhead import tiny_model

    tokenizer = tiny_model()
    cfg = load_config({
        "processors": [{"type": "llm", "server_args": {"model_path": tokenizer}, "default_sampling_params": {"max_new_tokens": 8}}],
        "loading_params": {
            "state_dir": str(state / "job"), "num_shards": SHARDS,
            "datasets": [{"path": path, "type": "JSONL" if kind == "jsonl" else "Parquet", "output_dir": str(state / "job-out")}],
        },
        "processing_params": {
            "inputs": [{"name": "question", "key": "question"}], "remove_columns": True,
            "outputs": [{"name": "answer", "type": "llm", "output_type": "plain", "prompt": "Answer: {{ question }}"}],
            "output_schema": {"answer": "{{ answer }}"},
        },
    })  # fmt: skip
    if index_only:
        index_datasets(cfg)
    return cfg, tokenizer


def _shard_job(kind: str, path: str, state: Path) -> int:
    """Shard LATE through the shard runner with an instant engine (no tokenizer: a trivial chat
    template, so the job's memory is the pipeline's, not transformers')."""
    from _engines import InstantEngine

    from mirageflow.shard.runner import run_shard

    cfg, _ = _job_config(kind, path, state)
    status = run_shard(cfg, LATE, engine_factory=lambda *a, **k: InstantEngine(None, "an answer", 2, chat="none"))
    return status["stats"]["rows_processed"]


WORKSPACE = "dedup_scale.py shards"


def measure_merge_dedup(root: Path, rows: int, cores: int) -> dict[tuple[str, str], dict]:
    """The merge, then each dedup stage, on dedup_scale.py's workspace of ``rows`` records."""
    from types import SimpleNamespace

    import dedup_scale as D

    from mirageflow.data.dedup import dedup_partitions

    t = time.perf_counter()
    D.build(root, rows, shards=True)
    print(f"{rows:,} rows of shards for the merge built in {time.perf_counter() - t:.0f} s", flush=True)
    out = {(WORKSPACE, "merge"): D.run_job("merge", root)}
    n = dedup_partitions(SimpleNamespace(num_shards=D.SHARDS))
    stages = []
    for step, jobs in D.stage_jobs(n):
        s = D.stage(step, root, jobs, cores)
        stages.append(s)
        out[(WORKSPACE, f"dedup: {step} ({jobs} jobs)")] = {**s, "rss_mb": s["max_rss_mb"]}
        print(step, s, flush=True)
    out[(WORKSPACE, "dedup: all stages")] = {
        **{k: sum(s[k] for s in stages) for k in ("wall", "cpu", "rchar")},
        "rss_mb": max(s["max_rss_mb"] for s in stages),
    }
    counts = json.loads((root / "state" / "new.json").read_text())
    print(
        f"dedup at {rows:,}: {counts['exact_duplicates_removed']:,} exact, {counts['near_duplicates_removed']:,} near removed", flush=True
    )
    shutil.rmtree(root)
    return out


def run_step(step: str, kind: str, path: Path, state: Path, src: str | None = None) -> dict:
    env = dict(os.environ)
    if src:
        env["BENCH_MIRAGEFLOW_SRC"] = src
    proc = subprocess.run(
        [sys.executable, __file__, "--child", step, kind, str(path), str(state)], capture_output=True, text=True, env=env
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{step} on {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(paths: dict[str, Path], root: Path, src: str | None = None) -> dict[tuple[str, str], dict]:
    out = {}
    for kind in KINDS:
        state = root / f"state-{kind}{'-other' if src else ''}"
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir()
        steps = ["index", "late shard"] + (["late shard, all columns"] if kind == "parquet-1rg" else [])
        steps += ["shard job"] if kind != "parquet" else []
        for step in steps:
            out[(kind, step)] = run_step(step, kind, paths[kind], state, src)
        if kind != "parquet-1rg" and not src:
            os.utime(paths[kind])  # touch: the same bytes, a new mtime and ctime
            for step in ("touch: driver", "touch: job"):
                out[(kind, step)] = run_step(step, kind, paths[kind], state)
    return out


# --------------------------------------------------------------------------- report


def _mb(n: float) -> str:
    return C.fmt(n / 1e6, 1)


def _x(a: float, b: float) -> str:
    return f"{b / a:.1f}x" if a > 0 else "-"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:6])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs=2, default=[200_000, 2_000_000])
    ap.add_argument("--compare-src", help="also measure the smaller size with this copy of src/ (e.g. the code before a change)")
    ap.add_argument("--tmp", help="folder for the datasets (default: a temp dir, removed at the end)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="dedup jobs at a time (a stage's parallel jobs)")
    args = ap.parse_args()
    cmd = "python scripts/bench/data_scale.py" + ("" if args.sizes == [200_000, 2_000_000] else f" --sizes {args.sizes[0]} {args.sizes[1]}")
    if args.compare_src:
        cmd += " --compare-src <other src>"
    info = C.machine("mirageflow", "pyarrow")
    small, big = args.sizes
    results: dict[int, dict] = {}
    sizes_on_disk: dict[int, dict] = {}
    build_s: dict[int, float] = {}
    other = None
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for rows in (small, big):
            root = Path(tmp) / str(rows)
            t = time.perf_counter()
            paths = build(root, rows)
            build_s[rows] = time.perf_counter() - t
            sizes_on_disk[rows] = {k: p.stat().st_size for k, p in paths.items()}
            results[rows] = measure(paths, root)
            if rows == small and args.compare_src:
                other = measure(paths, root, args.compare_src)
            for p in paths.values():  # disk space for the next size
                p.unlink()
            results[rows].update(measure_merge_dedup(root / "merge_dedup", rows, args.cores))
            print(f"{rows:,} rows done (built in {build_s[rows]:.0f} s)", flush=True)

    table_rows, growth_rows, figures = [], [], {}
    for (kind, step), a in results[small].items():
        b = results[big][(kind, step)]
        for rows, r in ((small, a), (big, b)):
            table_rows.append([kind, step, f"{rows:,}", C.fmt(r["wall"], 2), C.fmt(r["cpu"], 2), _mb(r["rchar"]), C.fmt(r["rss_mb"])])
        growth_rows.append(
            [kind, step, _x(a["wall"], b["wall"]), _x(a["cpu"], b["cpu"]), _x(a["rchar"], b["rchar"]), _x(a["rss_mb"], b["rss_mb"])]
        )
        key = f"{kind}_{step}".replace(" ", "_").replace(",", "").replace(":", "").replace("-", "_")
        figures[f"{key}_cpu_s_{big}"] = b["cpu"]
        figures[f"{key}_mb_read_{big}"] = b["rchar"] / 1e6
        figures[f"{key}_peak_rss_mb_{big}"] = b["rss_mb"]
    base_rss = min(r["base_rss_mb"] for res in results.values() for r in res.values() if "base_rss_mb" in r)
    files = ", ".join(f"{k} {_mb(sizes_on_disk[big][k])} MB" for k in KINDS)
    compare = ""
    if other:
        crow = [[kind, step, C.fmt(o["cpu"], 2), C.fmt(results[small][(kind, step)]["cpu"], 2), _mb(o["rchar"]),
                 _mb(results[small][(kind, step)]["rchar"]), C.fmt(o["rss_mb"]), C.fmt(results[small][(kind, step)]["rss_mb"])]
                for (kind, step), o in other.items()]  # fmt: skip
        compare = f"""
### {small:,} rows: the other code (`--compare-src`) vs this one

{C.table(["dataset", "step", "CPU s other", "CPU s this", "MB read other", "MB read this", "peak RSS MB other", "peak RSS MB this"], crow)}
"""
    body = f"""## Data at scale: index, a late shard's read, merge and dedup (`scripts/bench/data_scale.py`)

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{small:,} and {big:,} rows of ~1 KB (`id`, `question`, `context`); files at {big:,} rows: {files}.
{SHARDS} shards; the late shard is shard {LATE}. Each step in its own process: wall and CPU
(user + sys) of the step, MB read (`rchar`: every read, page cache or not), peak RSS of the
process (imports included: {base_rss:.0f} MB with pyarrow imported and nothing read; a shard
job's also holds the shard runner's imports and its index). The
machine is shared (2 CPUs, other jobs running): wall times are noisy, CPU and bytes are not.
How each step reads: [docs/data.md](docs/data.md).

{C.table(["dataset", "step", "rows", "wall s", "CPU s", "MB read", "peak RSS MB"], table_rows)}

Growth for 10x the rows ({small:,} -> {big:,}):

{C.table(["dataset", "step", "wall", "CPU", "MB read", "peak RSS"], growth_rows)}
{compare}
Reading it:
- The index reads each file once: a JSONL file's bytes once (rows, shard starts and SHA-256
  in one pass), a Parquet file's footer only (MB read constant, whatever the rows).
- A late shard of a Parquet file in 10,000-row groups reads about its own rows' column; in
  ONE row group it streams the group up to its rows (bytes grow with its position: what
  `mmirage check` warns about), in bounded memory.
- After `touch` the driver hashes a JSONL file once (a Parquet file: its footer), and a shard
  job then reads nothing of it.
- Merge and dedup ({WORKSPACE}: dedup_scale.py's records as 200 shards' outputs, JSONL):
  the merge holds one shard's parts at a time; each dedup stage runs
  {args.cores} jobs at a time, so its wall is the stage's and its CPU and bytes the sum of
  its jobs, and its peak RSS the largest job's: a job's share of the rows (8 shards at
  most), or (decide, finish) the duplicates.

Figures:

```
{chr(10).join(f"{k}: {v:.2f}" for k, v in figures.items())}
```
"""
    if not args.no_write:
        C.write_section("data_scale", body)
    print(body)


if __name__ == "__main__":
    main()
