"""Cost of checkpointing, and the work redone after a kill.

    python scripts/bench/checkpoint_cost.py             # ~2-3 min
    python scripts/bench/checkpoint_cost.py --rows 10000 --repeats 3 --trials 4

1. Throughput: the instant engine of pipeline_overhead.py, same rows and config, with
   the defaults (``checkpoint_rows: 500``, ``checkpoint_min_seconds: 1``: a Parquet part
   file + manifest, each fsynced, every 500 rows but at most once a second), with a commit
   every 500 rows however fast (``checkpoint_min_seconds: 0``), and with checkpointing
   effectively off (``checkpoint_rows`` and ``checkpoint_seconds`` huge: one commit at the
   end). Pinned to one CPU, interleaved repeats, medians.
2. Work redone after a kill: a shard runs in a subprocess with a slow-ish fake engine
   (5-25 ms per request, 32 in flight); the child appends each finished row (booked by the
   shard's ``RowFeeder.finished``: the ``rows_computed`` count) and each generated request
   id to logs (unbuffered, so they survive the kill); it is SIGKILLed at a random moment
   (seeded) after generation started, then rerun to completion with fresh logs. Rows
   recomputed = rows the second run computed that the first had already finished. Target:
   at most one commit interval (``checkpoint_rows``, with ``checkpoint_min_seconds: 0``)
   per kill, plus the rows that finished while the last commit was being written. Each
   trial also checks that the final output holds every row exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

KILL_CHECKPOINT_ROWS = 500


# --------------------------------------------------------------------------- child: one shard run


def child(cfg_path: str, log_prefix: str, seed: int) -> None:
    """One shard run; appends each generated request id to LOG.generated (the engine) and
    each finished row (record, filtered row or row error booked by the shard's RowFeeder) to
    LOG.finished, unbuffered, so both survive SIGKILL."""
    from _engines import SlowEngine

    from mirageflow.config import load_config
    from mirageflow.shard import row_feeder
    from mirageflow.shard.runner import run_shard

    fd = os.open(f"{log_prefix}.finished", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    original = row_feeder.RowFeeder.finished

    def finished(self, ds_index, row, record, exc, sample=None):  # the feeder's booking of a finished row
        before = self.budget.computed
        original(self, ds_index, row, record, exc, sample)
        if self.budget.computed > before:
            os.write(fd, f"{row.index}\n".encode())

    # the shard's RowFeeder books every finished row (record, filtered or row error) here;
    # run_shard makes its own, so the class's public method is wrapped in this child process
    row_feeder.RowFeeder.finished = finished
    cfg = load_config(json.loads(Path(cfg_path).read_text()))
    engine = SlowEngine(delay=(0.005, 0.025), log_path=f"{log_prefix}.generated", seed=seed, max_inflight=32)
    run_shard(cfg, 0, engine_factory=lambda *a, **k: engine)


# --------------------------------------------------------------------------- 1. throughput


def throughput(rows: int, repeats: int, tokenizer: str, work: Path) -> dict:
    from pipeline_overhead import pipeline_config, run_ours

    data = C.write_jsonl(work / "data.jsonl", C.make_rows(rows))
    cfgs = {}
    variants = (
        ("checkpoint_default", {}),
        ("checkpoint_every_500", {"checkpoint_rows": 500, "checkpoint_min_seconds": 0}),
        ("checkpoint_off", {"checkpoint_rows": 10**12, "checkpoint_seconds": 1e12}),
    )
    for name, params in variants:
        cfg = pipeline_config(data, work / f"out_{name}", work / f"state_{name}", "plain", tokenizer)
        cfg["shard_params"] = params
        cfgs[name] = cfg
    results = {name: [] for name in cfgs}
    run_ours(cfgs["checkpoint_default"], tokenizer, "plain")  # warm-up: imports, first-use caches
    for rep in range(repeats):
        for name, cfg in cfgs.items():
            cpu0 = time.process_time()
            res = run_ours(cfg, tokenizer, "plain")
            res["cpu_rows_per_sec"] = res["rows"] / (time.process_time() - cpu0)
            parts = len(list((work / f"out_{name}" / "shard_0").glob("part-*")))
            res["parts"] = parts
            results[name].append(res)
            print(f"repeat {rep + 1}/{repeats} {name}: {res['rows_per_sec']:,.0f} rows/s, {parts} part files", file=sys.stderr, flush=True)
    return results


# --------------------------------------------------------------------------- 2. kills


def _shard_config(data: Path, work: Path) -> dict:
    return {
        "processors": [{"type": "llm", "server_args": {"model_path": "unused"}, "apply_chat_template": False}],
        "loading_params": {
            "state_dir": str(work / "state"),
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(work / "out")}],
            "num_shards": 1,
        },
        "shard_params": {"checkpoint_rows": KILL_CHECKPOINT_ROWS, "checkpoint_min_seconds": 0},
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}, {"name": "id", "key": "id"}],
            "outputs": [{"name": "answer", "prompt": "{{ text }}"}],
            "remove_columns": True,
            "output_schema": {"id": "{{ id }}", "answer": "{{ answer }}"},
        },
    }


def _ids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def kill_trial(trial: int, rows: int, seed: int, work: Path) -> dict:
    from mirageflow.config import load_config
    from mirageflow.data.writers import read_parts
    from mirageflow.shard.runner import index_datasets

    tdir = work / f"trial_{trial}"
    data = C.write_jsonl(tdir / "data.jsonl", C.make_rows(rows, seed=trial))
    cfg_dict = _shard_config(data, tdir)
    cfg = load_config(cfg_dict)
    index_datasets(cfg)
    cfg_path = tdir / "config.json"
    cfg_path.write_text(json.dumps(cfg_dict))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(C.ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    me = str(Path(__file__).resolve())

    # first run, killed at a random moment once generation started
    log1, log2 = tdir / "run1", tdir / "run2"
    gen1 = tdir / "run1.generated"
    rng = random.Random(seed * 1000 + trial)
    proc = subprocess.Popen(
        [sys.executable, me, "--child", str(cfg_path), str(log1), str(trial)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not gen1.exists() or gen1.stat().st_size == 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"trial {trial}: the first run ended before generating (rc {proc.returncode})")
        time.sleep(0.005)
    started = time.monotonic()
    time.sleep(rng.uniform(0.2, 2.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_after = time.monotonic() - started
    finished1 = set(_ids(tdir / "run1.finished"))
    generated1 = set(_ids(gen1))
    manifest = json.loads((cfg.shard_dir(0) / "checkpoint.json").read_text())
    committed1 = sum(b - a for d in manifest["datasets"].values() for key in ("done", "failed") for a, b in d[key])

    # second run to completion (a dead holder's lease on this host is taken over)
    out = subprocess.run(
        [sys.executable, me, "--child", str(cfg_path), str(log2), str(trial + 1000)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"trial {trial}: the rerun failed:\n{out.stderr[-3000:]}")
    computed2 = _ids(tdir / "run2.generated")
    recomputed = len(finished1 & set(computed2))
    records = read_parts(tdir / "out" / "shard_0", "parquet").to_pylist()
    indices = sorted(r["source_index"] for r in records)
    assert indices == list(range(rows)), f"trial {trial}: output rows are not each row exactly once"
    assert all(r["answer"] == f"answer {r['source_index']}" for r in records)
    shutil.rmtree(tdir, ignore_errors=True)
    return {
        "trial": trial,
        "killed_after_s": killed_after,
        "generated_before_kill": len(generated1),
        "finished_before_kill": len(finished1),
        "committed_before_kill": committed1,
        "computed_by_rerun": len(computed2),
        "recomputed": recomputed,
        "regenerated": len(generated1 & set(computed2)),
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000, help="rows for the throughput part")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trials", type=int, default=8, help="kills")
    ap.add_argument("--kill-rows", type=int, default=8000, help="rows of the shard that is killed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from pipeline_overhead import tiny_model

    tokenizer = tiny_model()
    info = C.machine("mirageflow", "pyarrow", "transformers")
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        pinned = "not pinned" if args.no_pin else C.pin_to_one_core()
        tp = throughput(args.rows, args.repeats, tokenizer, work)
        if affinity:
            os.sched_setaffinity(0, affinity)  # the kill trials run a child and its parent
        trials = []
        for t in range(args.trials):
            res = kill_trial(t, args.kill_rows, args.seed, work)
            trials.append(res)
            print(f"kill {t + 1}/{args.trials}: {json.dumps(res)}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: C.median([r["rows_per_sec"] for r in rs]) for name, rs in tp.items()}
    cpu = {name: C.median([r["cpu_rows_per_sec"] for r in rs]) for name, rs in tp.items()}
    redone = [t["recomputed"] for t in trials]
    figures = {
        "rows_per_sec_checkpoint_default": med["checkpoint_default"],
        "rows_per_sec_checkpoint_every_500": med["checkpoint_every_500"],
        "rows_per_sec_checkpoint_off": med["checkpoint_off"],
        "checkpoint_default_throughput_ratio": med["checkpoint_default"] / med["checkpoint_off"],
        "checkpoint_every_500_throughput_ratio": med["checkpoint_every_500"] / med["checkpoint_off"],
        "cpu_rows_per_sec_checkpoint_default": cpu["checkpoint_default"],
        "cpu_rows_per_sec_checkpoint_every_500": cpu["checkpoint_every_500"],
        "cpu_rows_per_sec_checkpoint_off": cpu["checkpoint_off"],
        "kill_trials": len(trials),
        "rows_recomputed_per_kill_median": C.median(redone),
        "rows_recomputed_per_kill_max": max(redone),
        "rows_regenerated_per_kill_max": max(t["regenerated"] for t in trials),
        "commit_interval_rows": KILL_CHECKPOINT_ROWS,
    }
    if not args.no_write:
        cmd = "python scripts/bench/checkpoint_cost.py" + "".join(f" {a}" for a in sys.argv[1:])
        tp_rows = [
            [name, C.fmt(med[name]), ", ".join(C.fmt(r["rows_per_sec"]) for r in rs), C.fmt(cpu[name]), rs[0]["parts"]]
            for name, rs in tp.items()
        ]
        kill_rows = [
            [
                t["trial"],
                f"{t['killed_after_s']:.2f}",
                t["generated_before_kill"],
                t["finished_before_kill"],
                t["committed_before_kill"],
                t["computed_by_rerun"],
                t["recomputed"],
                t["regenerated"],
            ]
            for t in trials
        ]
        body = f"""## Checkpoint cost (`scripts/bench/checkpoint_cost.py`)

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
Throughput with the instant engine (the `ours_plain` pipeline of `pipeline_overhead.py`),
{args.rows:,} rows, {pinned}, {args.repeats} interleaved repeats, median. Each commit is a
Parquet part file and the manifest, each fsynced, written by the shard's writer thread.
`checkpoint_default`: every 500 rows but at most once a second (`checkpoint_min_seconds` 1);
`checkpoint_every_500`: every 500 rows however fast (`checkpoint_min_seconds` 0);
`checkpoint_off`: `checkpoint_rows` and `checkpoint_seconds` huge, one commit at the end. A batch that comes
due while the writer thread still writes the last one grows until that write is done, so there can be
fewer part files than rows / 500. rows/s per CPU-second leaves out time the process waited (fsync,
other tenants of the machine).

{C.table(["variant", "median rows/s", "all repeats", "rows per CPU-second", "part files"], tp_rows)}

Work redone after SIGKILL: a shard of {args.kill_rows:,} rows with a fake engine of 5-25 ms per
request (32 in flight), `checkpoint_rows` {KILL_CHECKPOINT_ROWS} and `checkpoint_min_seconds` 0, killed at a seeded random moment
0.2-2.5 s after generation started, then rerun to completion. Recomputed = rows the rerun
computed that the killed run had already finished (booked by the shard's row feeder as a
record or a row error, the `rows_computed` count); regenerated = rows the rerun computed whose
generation the killed run had completed (also counts rows the engine had answered but
the runner had not yet collected when the kill came). Every trial's output holds each row
exactly once.

{C.table(["trial", "killed after s", "generated before kill", "finished before kill", "committed before kill", "computed by rerun", "recomputed", "regenerated"], kill_rows)}

Figures:

```
{chr(10).join(f"{k}: {v:.3f}" if isinstance(v, float) and v < 10 else f"{k}: {v:.0f}" for k, v in figures.items())}
```
"""
        C.write_section("checkpoint_cost", body)
    C.print_figures(figures)


if __name__ == "__main__":
    main()
