"""Snakemake at scale: DAG dry-run time and memory for many shards, and per-job overhead of a local run.

    python scripts/bench/snakemake_scale.py                 # all parts, writes BENCHMARKS.md
    python scripts/bench/snakemake_scale.py --run-shards 0  # dry runs only
    python scripts/bench/snakemake_scale.py --no-write
    python scripts/bench/snakemake_scale.py --job-parse-only   # part 2 alone, its own dated section

Everything runs in a scratch directory against this checkout's Snakefile, with a real
pipeline config: a generated JSONL dataset (--rows, 20,000 by default, and at least as
many rows as the largest shard count: num_shards > rows is refused), the tiny test model
(scripts/make_tiny_model.py), one plain output, merge on.

1. Dry run (``snakemake -n``) of the whole DAG for each --shards count (1,000, 10,000, 30,000),
   before the dataset is indexed (index job + N shards + aggregate + merge + all). Wall
   time, CPU time (user+sys) and peak memory: the max RSS of the process tree (wait4) and
   the peak of the tree's summed RSS sampled every 20 ms (psutil).
2. Per-job parse cost: what a cluster job pays before it runs its shard. A SLURM job
   runs the command Snakemake's executor writes for it (``JOB_ARGS``: ``python -m snakemake
   --target-jobs shard:shard=K --allowed-rules shard ... --mode remote --executor
   slurm-jobstep``), which parses the whole Snakefile again; anything there that grows
   with num_shards is paid by every job. Measured as that command with ``-n`` (the parse
   and the one-job DAG, not the shard itself) in a state_dir where the driver has indexed
   the dataset and written the records fingerprint (what a job finds when it starts), for
   each --shards count; next to it the same command on a one-rule Snakefile (Snakemake's
   own floor: its imports and plugins, paid whatever the workflow), and the floor's parts:
   the interpreter alone, ``python -m snakemake --version`` (Snakemake's imports, every
   installed plugin with them) and, by ``python -X importtime``, the shares of that import
   time by package. The Snakefile parse
   alone (``snakemake --list-rules``) is measured up to 100,000 shards: none may grow with
   N. What a shard job reads of the dataset index is measured too (``load_shard``: the JSON
   header and its entry of the offsets table): bytes and time, which must not grow with N
   either.
3. A local run (``--cores 1``) of --run-shards shards of --rows-per-shard rows each with
   max_new_tokens 4 on the tiny model: total wall time vs the sum of the shards'
   runtime_seconds (status.json). Overhead per job = (wall - sum of shard runtimes - the
   index/aggregate/merge jobs) / shards: Snakemake scheduling + a fresh Python process +
   imports + config validation, outside the shard's own clock. The shard's own fixed cost
   (model_load_seconds: torch/transformers imports + model load) is reported apart.

The SLURM executor plugin runs ``scontrol show config`` once whenever Snakemake loads it,
even for a local run. Where SLURM is installed but no controller answers (a dev machine
after the SLURM tests), that call waits 9 s before it gives up; the script then puts an
``scontrol`` that fails at once first on PATH, as on a machine without SLURM, and reports
the probe's time apart. On a cluster it answers in milliseconds.

Runs are interleaved and repeated (--repeats); figures are medians. Printed last, one per
line, ``name: value``; the ``snakemake_scale`` section of BENCHMARKS.md is regenerated.
"""

from __future__ import annotations

from _common import git_rev, machine, transformers_processor, write_section

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEFILE = REPO / "Snakefile"
SECTION = "snakemake_scale"
JOB_PARSE_SECTION = "snakemake_job_parse"  # --job-parse-only: part 2 alone, dated, after the whole section
TARGET_DRYRUN_10K_S = 20.0


# --------------------------------------------------------------------------- measuring a command


def measure(cmd: list[str], cwd: Path, env: dict | None = None) -> dict:
    """Run cmd; wall, CPU (user+sys, whole tree), max RSS of any process in the tree, peak summed tree RSS."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = [0]
    done = threading.Event()

    def sample():
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            peak[0] = max(peak[0], total)
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_chunks = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    reader.join()
    output = b"".join(out_chunks).decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
    return {
        "wall_s": wall,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "max_rss_mb": ru.ru_maxrss / 1024,  # KiB on Linux
        "tree_rss_mb": peak[0] / 2**20,
        "output": output,
    }


def snakemake(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", *args, "--snakefile", str(SNAKEFILE), "--directory", str(workdir), "--configfile", str(workdir / "pipeline.yaml")]  # fmt: skip


# --------------------------------------------------------------------------- inputs


def write_dataset(path: Path, rows: int) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, "title": f"Title {i}", "text": f"Passage number {i} about rivers and mountains."}) + "\n")


def pipeline(model: Path, dataset: Path, shards: int, new_tokens: int = 4) -> dict:
    return {
        "processors": [transformers_processor(model, new_tokens)],
        "loading_params": {
            "state_dir": "state",
            "datasets": [{"path": str(dataset), "type": "JSONL", "output_dir": "out"}],
            "num_shards": shards,
            "batch_size": 4,
        },
        "processing_params": {
            "inputs": [{"name": "id", "key": "id"}, {"name": "title", "key": "title"}],
            "outputs": [{"name": "headline", "type": "llm", "output_type": "plain", "prompt": "Write a headline for {{ title }}."}],
            "remove_columns": True,
            "output_schema": {"id": "{{ id }}", "headline": "{{ headline }}"},
        },
        "execution_params": {"merge": True},
    }


def workdir(root: Path, name: str, cfg: dict) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return d


def slurm_probe(root: Path) -> dict:
    """Time the SLURM plugin's load-time ``scontrol show config``; when it only waits for an
    absent controller, put an scontrol that fails at once first on PATH (see the docstring)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return {"probe_s": None, "stubbed": False}
    t0 = time.perf_counter()
    try:
        ok = subprocess.run([exe, "show", "config"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    took = time.perf_counter() - t0
    stubbed = not ok and took > 2.0
    if stubbed:
        stub = root / "no-slurm-bin"
        stub.mkdir()
        (stub / "scontrol").write_text("#!/bin/sh\nexit 1\n")
        (stub / "scontrol").chmod(0o755)
        os.environ["PATH"] = f"{stub}{os.pathsep}{os.environ['PATH']}"
    return {"probe_s": took, "answered": ok, "stubbed": stubbed}


def job_count(output: str) -> int | None:
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "total" and parts[1].isdigit():
            return int(parts[1])
    return None


# --------------------------------------------------------------------------- parts


DRY_MODES = {"quiet": ["-n", "--quiet"], "verbose": ["-n"]}  # summary only / every job printed (plain `snakemake -n`)


def dry_runs(root: Path, model: Path, dataset: Path, shard_counts: list[int], repeats: int, modes: list[str]) -> dict:
    dirs = {n: workdir(root, f"dry-{n}", pipeline(model, dataset, n)) for n in shard_counts}
    runs: dict[tuple, list[dict]] = {(n, mode): [] for n in shard_counts for mode in modes}
    for r in range(repeats):
        for n in shard_counts if r % 2 == 0 else reversed(shard_counts):
            for mode in modes:
                flags = DRY_MODES[mode]
                m = measure(snakemake(dirs[n], *flags, "--cores", "1"), dirs[n])
                m["jobs"] = job_count(m.pop("output"))
                runs[n, mode].append(m)
                print(
                    f"[dry-run {n} shards, {mode}] {m['wall_s']:.1f} s wall, {m['cpu_s']:.1f} s CPU, {m['max_rss_mb']:.0f} MB, {m['jobs']} jobs",
                    file=sys.stderr,
                )
    out = {}
    for n in shard_counts:
        out[n] = {mode: summarize(runs[n, mode]) for mode in modes}
        out[n]["jobs"] = max(x["jobs"] or 0 for mode in modes for x in runs[n, mode])
    return out


# What a SLURM job runs (snakemake-interface-executor-plugins 9.4 RealExecutor.format_job_exec,
# Snakemake 9's SpawnedJobArgsFactory.general_args, and the SLURM plugin's
# ``--executor slurm-jobstep --jobs 1``) for shard 0 of a run started with profiles/slurm,
# less the per-run options that change nothing in the parse (storage prefixes, default
# resources, wrapper prefix). ``-n`` stops after the parse and the one-job DAG.
JOB_ARGS = [
    "--target-jobs", "shard:shard=0", "--allowed-rules", "shard", "--cores", "all", "--attempt", "1",
    "--force-use-threads", "--force", "--target-files-omit-workdir-adjustment", "--max-inventory-time", "0",
    "--retries", "0", "--nocolor", "--no-hooks", "--nolock", "--ignore-incomplete", "--rerun-triggers", "mtime",
    "--scheduler", "greedy", "--latency-wait", "5", "--mode", "remote", "--executor", "slurm-jobstep", "--jobs", "1", "-n",
]  # fmt: skip
FLOOR_SNAKEFILE = """rule shard:
    output: "state/shard_{shard}/status.json"
    shell: "touch {output}"
"""


# Who imports what at `import snakemake` (snakemake 9.27, SLURM plugin 2.8): grouped by
# top-level package, the groups named for the importer that makes a job pay them.
IMPORT_GROUPS = {
    "pandas, numpy (the SLURM plugin's efficiency report, imported with the plugin)": ("pandas", "numpy", "pytz", "dateutil", "tzdata"),
    "sqlalchemy, sqlmodel, pydantic (Snakemake's persistence records)": ("sqlalchemy", "sqlmodel", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "greenlet"),
    "snakemake and its plugin interfaces": ("snakemake", "snakemake_interface_common", "snakemake_interface_executor_plugins", "snakemake_interface_storage_plugins", "snakemake_interface_report_plugins", "snakemake_interface_logger_plugins", "snakemake_interface_scheduler_plugins", "snakemake_executor_plugin_slurm", "snakemake_executor_plugin_slurm_jobstep"),
    "docutils, jinja2, PIL (Snakemake's report)": ("docutils", "jinja2", "markupsafe", "PIL"),
}  # fmt: skip


def import_shares(repeats: int) -> dict[str, float]:
    """Shares of `python -X importtime -m snakemake --version`'s import time (self times,
    wall clock, so shares only), by IMPORT_GROUPS, medians over the repeats."""
    import re

    line = re.compile(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)")
    owner = {pkg: group for group, pkgs in IMPORT_GROUPS.items() for pkg in pkgs}
    shares: dict[str, list[float]] = {}
    for _ in range(repeats):
        err = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "snakemake", "--version"], capture_output=True, text=True, check=True
        ).stderr
        totals: dict[str, int] = {}
        for m in line.finditer(err):
            group = owner.get(m.group(2).split(".")[0], "everything else (stdlib, yaml, pulp, smart_open, ...)")
            totals[group] = totals.get(group, 0) + int(m.group(1))
        whole = sum(totals.values())
        for group, us in totals.items():
            shares.setdefault(group, []).append(us / whole)
    return {g: statistics.median(v) for g, v in sorted(shares.items(), key=lambda kv: -statistics.median(kv[1]))}


def distributions(python: str) -> int:
    """How many distributions an interpreter's environment holds (Snakemake's plugin registries list them all)."""
    code = "import importlib.metadata as m; print(len(list(m.distributions())))"
    return int(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def job_parse(root: Path, model: Path, dataset: Path, shard_counts: list[int], repeats: int, other_pythons: list[Path] = ()) -> dict:
    """What one cluster job pays before its shard runs: the job's snakemake parses everything again."""
    dirs = {}
    for n in shard_counts:
        d = workdir(root, f"job-{n}", pipeline(model, dataset, n))
        index = "state/datasets/dataset_0.index.json"
        fingerprint = "state/records.fingerprint"
        if not (d / index).exists():  # what the driver has made before it submits a shard
            subprocess.run([*snakemake(d, "--cores", "1", "--quiet"), "--", index, fingerprint], check=True, capture_output=True)
        dirs[n] = d
    floor = root / "floor"
    floor.mkdir(exist_ok=True)
    (floor / "Snakefile").write_text(FLOOR_SNAKEFILE)
    floor_cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(floor / "Snakefile"), "--directory", str(floor), *JOB_ARGS]
    # the floor's parts: the interpreter alone, then Snakemake's imports (with every installed
    # plugin, which its plugin registries import) and its argument parser, no workflow
    parts = {
        "python": [sys.executable, "-c", "pass"],
        "snakemake_version": [sys.executable, "-m", "snakemake", "--version"],
        "floor": floor_cmd,
    }
    envs = {sys.executable: distributions(sys.executable)}
    for python in map(str, other_pythons):  # the floor in other environments (--floor-python)
        label = f"environment `{Path(python).parent.parent.name}` ({distributions(python)} distributions)"
        parts[f"snakemake_version@{label}"] = [python, "-m", "snakemake", "--version"]
        parts[f"floor@{label}"] = [python, *floor_cmd[1:]]
    names: list[int | str] = [*parts, *shard_counts]
    runs: dict[int | str, list[dict]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names if r % 2 == 0 else reversed(names):
            m = measure(parts[n] if n in parts else [*snakemake(dirs[n], *JOB_ARGS)], floor if n in parts else dirs[n])
            output = m.pop("output")
            if not str(n).startswith(("python", "snakemake_version")) and ("shard" not in output or job_count(output) != 1):
                raise RuntimeError(f"the job's command did not plan one shard job:\n{output[-2000:]}")
            runs[n].append(m)
            print(f"[job parse {n}] {m['wall_s']:.2f} s wall, {m['cpu_s']:.2f} s CPU", file=sys.stderr)
    out: dict = {n: summarize(v) for n, v in runs.items()}
    out["import_shares"] = import_shares(repeats)
    out["distributions"] = envs[sys.executable]
    from mirageflow.config import load_config
    from mirageflow.data.readers import SHARD_START, load_shard, offsets_path

    for n, d in dirs.items():  # what a shard job reads of the index: header + its table entry
        path = d / "state" / "datasets" / "dataset_0.index.json"
        cfg = load_config(pipeline(model, dataset, n), check_paths=False)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            load_shard(path, cfg.datasets[0], n, n // 2)
            times.append(time.perf_counter() - t0)
        out[n]["index_header_bytes"] = path.stat().st_size
        out[n]["index_table_bytes"] = offsets_path(path).stat().st_size
        out[n]["index_read_bytes"] = path.stat().st_size + SHARD_START.size
        out[n]["index_read_ms"] = statistics.median(times) * 1000
    return out


def parse_only(root: Path, model: Path, dataset: Path, shard_counts: list[int], repeats: int) -> dict:
    """Parsing the Snakefile alone (``snakemake --list-rules``): config validation + rule declarations."""
    dirs = {n: workdir(root, f"parse-{n}", pipeline(model, dataset, n)) for n in shard_counts}
    runs: dict[int, list[dict]] = {n: [] for n in shard_counts}
    for r in range(repeats):
        for n in shard_counts if r % 2 == 0 else reversed(shard_counts):
            m = measure(snakemake(dirs[n], "--list-rules"), dirs[n])
            m.pop("output")
            runs[n].append(m)
            print(f"[parse {n} shards] {m['wall_s']:.2f} s wall, {m['cpu_s']:.2f} s CPU", file=sys.stderr)
    return {n: summarize(v) for n, v in runs.items()}


def local_run(root: Path, model: Path, shards: int, rows_per_shard: int) -> dict:
    dataset = root / "small.jsonl"
    write_dataset(dataset, shards * rows_per_shard)
    d = workdir(root, f"run-{shards}", pipeline(model, dataset, shards))
    m = measure(snakemake(d, "--cores", "1"), d)
    m.pop("output")
    statuses = [json.loads(p.read_text()) for p in sorted((d / "state").glob("shard_*/status.json"))]
    assert len(statuses) == shards, f"{len(statuses)} status files for {shards} shards"
    st = [s["stats"] for s in statuses]
    spans = sorted((datetime.fromisoformat(s["started_at"]), datetime.fromisoformat(s["finished_at"])) for s in statuses)
    gaps = [(spans[i + 1][0] - spans[i][1]).total_seconds() for i in range(len(spans) - 1)]
    sum_runtime = sum(s["runtime_seconds"] for s in st)
    shard_span = (spans[-1][1] - spans[0][0]).total_seconds()
    return {
        "shards": shards,
        "rows": shards * rows_per_shard,
        "wall_s": m["wall_s"],
        "cpu_s": m["cpu_s"],
        "sum_shard_runtime_s": sum_runtime,
        "shard_span_s": shard_span,
        "overhead_per_job_s": (shard_span - sum_runtime) / (shards - 1) if shards > 1 else None,
        "wall_minus_runtime_per_job_s": (m["wall_s"] - sum_runtime) / shards,
        "before_first_and_after_last_s": m["wall_s"] - shard_span,
        "gap_median_s": statistics.median(gaps) if gaps else None,
        "model_load_median_s": statistics.median(s["model_load_seconds"] for s in st),
        "inference_median_s": statistics.median(s["inference_runtime_seconds"] for s in st),
        "runtime_median_s": statistics.median(s["runtime_seconds"] for s in st),
    }


def summarize(runs: list[dict]) -> dict:
    keys = ("wall_s", "cpu_s", "max_rss_mb", "tree_rss_mb")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"all_wall_s": [round(r["wall_s"], 1) for r in runs]}


# --------------------------------------------------------------------------- BENCHMARKS.md


def figures(dry: dict, parse: dict, run: dict | None, parsed: dict, probe: dict) -> dict:
    out = {"slurm_probe_s": None if probe["probe_s"] is None else round(probe["probe_s"], 2), "slurm_probe_stubbed": probe["stubbed"]}
    for n, r in dry.items():
        if "quiet" in r:
            q = r["quiet"]
            out[f"dryrun_{n}_shards_wall_s"] = round(q["wall_s"], 2)
            out[f"dryrun_{n}_shards_cpu_s"] = round(q["cpu_s"], 2)
        out[f"dryrun_{n}_shards_max_rss_mb"] = round(max(r[m]["max_rss_mb"] for m in DRY_MODES if m in r), 1)
        out[f"dryrun_{n}_shards_tree_rss_mb"] = round(max(r[m]["tree_rss_mb"] for m in DRY_MODES if m in r), 1)
        if "verbose" in r:
            v = r["verbose"]
            out[f"dryrun_{n}_shards_printing_jobs_wall_s"] = round(v["wall_s"], 2)
            out[f"dryrun_{n}_shards_printing_jobs_cpu_s"] = round(v["cpu_s"], 2)
    out["job_parse_python_cpu_s"] = round(parse["python"]["cpu_s"], 2)
    out["job_parse_snakemake_version_cpu_s"] = round(parse["snakemake_version"]["cpu_s"], 2)
    out["job_parse_snakemake_floor_cpu_s"] = round(parse["floor"]["cpu_s"], 2)
    for n, r in parse.items():
        if not isinstance(n, int):
            continue
        out[f"job_parse_{n}_shards_cpu_s"] = round(r["cpu_s"], 2)
        out[f"job_parse_{n}_shards_max_rss_mb"] = round(r["max_rss_mb"], 1)
        out[f"index_read_{n}_shards_bytes"] = r["index_read_bytes"]
        out[f"index_read_{n}_shards_ms"] = round(r["index_read_ms"], 3)
    for n, r in parsed.items():
        out[f"parse_only_{n}_shards_cpu_s"] = round(r["cpu_s"], 2)
    if run:
        out["run_shards"] = run["shards"]
        out["run_wall_s"] = round(run["wall_s"], 1)
        out["run_sum_shard_runtime_s"] = round(run["sum_shard_runtime_s"], 1)
        out["run_overhead_per_job_s"] = round(run["overhead_per_job_s"], 3)
        out["run_wall_minus_runtime_per_job_s"] = round(run["wall_minus_runtime_per_job_s"], 3)
        out["run_model_load_per_job_s"] = round(run["model_load_median_s"], 3)
        out["run_inference_per_job_s"] = round(run["inference_median_s"], 3)
    return out


def job_parse_lines(parse: dict) -> list[str]:
    """The table of what one cluster job pays before its shard runs, with the floor's parts."""
    floor = parse["floor"]["cpu_s"]
    counts = [n for n in parse if isinstance(n, int)]
    lines = [
        "### What one cluster job pays before its shard runs",
        "",
        "The command a SLURM job runs for shard 0 (`python -m snakemake " + " ".join(JOB_ARGS) + "`: the job's "
        "own parse of the workflow and its one-job DAG; `-n` stops before the shard), in a state_dir where the "
        "driver has indexed the dataset and written the records fingerprint; and what its shard reads of the "
        "dataset index (`load_shard`: the JSON header and its 16-byte entry of the offsets table, whatever the "
        "number of shards). The lines before the shard counts are Snakemake's own floor and its parts: the "
        "interpreter alone, `python -m snakemake --version` (Snakemake's imports, with every installed plugin, "
        "which its plugin registries import, and its argument parser), and the job's command on a one-rule "
        "Snakefile, paid whatever the workflow (with `--floor-python`, the same in other environments: their "
        "directory's name and how many distributions they hold); the workflow's own part is the difference "
        "to the floor in this environment.",
        "",
        "| shards | wall s | CPU s | CPU s over Snakemake's floor | max RSS MB | index header bytes | offsets table bytes | bytes a shard reads | load_shard ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    env = f", this environment ({parse['distributions']} distributions)" if "distributions" in parse else ""
    labels = {
        "python": "Python alone (`python -c pass`)",
        "snakemake_version": f"Snakemake's imports (`python -m snakemake --version`){env}",
        "floor": f"Snakemake's floor (one-rule Snakefile){env}",
    }
    for part in parse:  # --floor-python: the same in other environments
        if isinstance(part, str) and "@" in part:
            what, where = part.split("@", 1)
            labels[part] = f"{labels[what].removesuffix(env)}, {where}"
    for part, label in labels.items():
        m = parse[part]
        lines.append(f"| {label} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | - | {m['max_rss_mb']:.0f} | - | - | - | - |")
    for n in counts:
        r = parse[n]
        lines.append(
            f"| {n:,} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['cpu_s'] - floor:.2f} | {r['max_rss_mb']:.0f} | "
            f"{r['index_header_bytes']:,} | {r['index_table_bytes']:,} | {r['index_read_bytes']:,} | {r['index_read_ms']:.2f} |"
        )
    shares = parse.get("import_shares") or {}
    if shares:
        lines += [
            "",
            "Where `python -m snakemake --version`'s import time goes (`python -X importtime`, self times grouped by "
            "top-level package; wall-clock based, so shares only):",
            "",
            "| imported | share |",
            "|---|---|",
            *[f"| {group} | {share:.0%} |" for group, share in shares.items()],
        ]
    if counts:
        n = counts[0]
        lines += [
            "",
            f"A SLURM job starts Snakemake twice before its shard (the batch script's `--executor slurm-jobstep`, "
            f"then a second `python -m snakemake` for the same job inside `srun`: docs/cluster.md), so at {n:,} shards one job pays about "
            f"{2 * parse[n]['cpu_s']:.1f} CPU-s before its shard, of which {2 * (parse[n]['cpu_s'] - floor):.1f} are the "
            f"workflow's and {2 * parse['snakemake_version']['cpu_s']:.1f} Snakemake's imports alone.",
        ]
    return lines


def section(cmd: str, info: dict, args, dry: dict, parse: dict, run: dict | None, parsed: dict, load: tuple, probe: dict) -> str:
    if probe["probe_s"] is None:
        probe_text = "No `scontrol` on this machine: the SLURM plugin's load-time probe fails at once."
    elif probe["stubbed"]:
        probe_text = (
            f"`scontrol show config` took {probe['probe_s']:.1f} s here and failed (SLURM installed, no controller "
            "running). The SLURM plugin runs it once whenever Snakemake loads it, even for local runs, so every "
            "Snakemake command below ran with an `scontrol` that fails at once first on PATH, as on a machine "
            "without SLURM; on a cluster it answers in milliseconds. Add that wait to each figure for a machine "
            "in this state."
        )
    else:
        probe_text = f"`scontrol show config` (run once by the SLURM plugin when Snakemake loads it) answered in {probe['probe_s']:.2f} s."
    lines = [
        "## Snakemake at scale: DAG dry run, per-job parse, per-job overhead of a local run",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, Snakemake {info['versions']['snakemake']}, "
        f"SLURM plugin {info['versions']['snakemake-executor-plugin-slurm']}; commit {git_rev()}; {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; "
        f"load average {load[0]:.2f} at start, {load[1]:.2f} at end (shared machine: wall times include waiting "
        "for the CPU, CPU times do not).",
        "",
        f"Workflow: `{os.path.relpath(SNAKEFILE, REPO)}`. Config: one JSONL dataset of {args.rows:,} rows, the tiny test model, one plain "
        f"output, merge on. Medians of {args.repeats} interleaved repeats.",
        "",
        probe_text,
        "",
        "### Dry run of the whole DAG (dataset not indexed yet)",
        "",
        "`snakemake -n --quiet` builds the DAG and prints the job counts; plain `snakemake -n` also prints every job.",
        "",
        "| shards | jobs | command | wall s | CPU s | max RSS MB (largest process) | peak tree RSS MB (sampled) | every wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in dry.items():
        jobs = f"{r['jobs']:,}" if r["jobs"] else "-"  # `-n --quiet` prints no job count
        for mode, flags in DRY_MODES.items():
            if mode not in r:
                continue
            m = r[mode]
            lines.append(
                f"| {n:,} | {jobs} | `snakemake {' '.join(flags)}` | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | {m['max_rss_mb']:.0f} | "
                f"{m['tree_rss_mb']:.0f} | {m['all_wall_s']} |"
            )
    if 10000 in dry:
        r = dry[10000]
        verdict = lambda m: "met" if m["wall_s"] <= TARGET_DRYRUN_10K_S else "NOT met"  # noqa: E731
        said = [
            f"`snakemake {' '.join(DRY_MODES[mode])}` **{verdict(r[mode])}** ({r[mode]['wall_s']:.1f} s wall, {r[mode]['cpu_s']:.1f} s CPU)"
            for mode in DRY_MODES
            if mode in r
        ]
        lines += ["", f"Target: 10,000 shards in <= {TARGET_DRYRUN_10K_S:.0f} s: " + "; ".join(said) + "."]
    counts = sorted(dry)
    if len(counts) > 1 and all("quiet" in dry[n] for n in counts):
        steps = [
            f"{a:,} -> {b:,} shards (x{b / a:.0f}): CPU x{dry[b]['quiet']['cpu_s'] / dry[a]['quiet']['cpu_s']:.1f}, "
            f"max RSS x{dry[b]['quiet']['max_rss_mb'] / dry[a]['quiet']['max_rss_mb']:.1f}"
            for a, b in zip(counts, counts[1:])
        ]
        # linear in shards: each added shard costs the same, whatever the count (the fixed
        # start-up makes the ratios above smaller than the shard ratio)
        added = [
            f"{a:,} -> {b:,}: {(dry[b]['quiet']['cpu_s'] - dry[a]['quiet']['cpu_s']) / (b - a) * 1000:.2f} ms CPU, "
            f"{(dry[b]['quiet']['max_rss_mb'] - dry[a]['quiet']['max_rss_mb']) / (b - a) * 1024:.0f} KB"
            for a, b in zip(counts, counts[1:])
        ]
        lines += ["", "Growth of `-n --quiet`: " + "; ".join(steps) + ".", "", "Cost of one more shard: " + "; ".join(added) + "."]
    lines += ["", *job_parse_lines(parse)]
    lines += [
        "",
        "Parsing the Snakefile alone (`snakemake --list-rules`: config validation and rule declarations), the part "
        "of every job's start that could grow with num_shards:",
        "",
        "| shards | wall s | CPU s |",
        "|---|---|---|",
    ]
    for n, r in parsed.items():
        lines.append(f"| {n:,} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} |")
    if run:
        lines += [
            "",
            f"### Local run: {run['shards']} shards x {run['rows'] // run['shards']} rows, max_new_tokens 4, `--cores 1`",
            "",
            "| figure | seconds |",
            "|---|---|",
            f"| total wall time | {run['wall_s']:.1f} |",
            f"| sum of shard runtime_seconds (status.json) | {run['sum_shard_runtime_s']:.1f} |",
            f"| index + aggregate + merge + start/stop (wall outside the first..last shard span) | {run['before_first_and_after_last_s']:.1f} |",
            f"| **overhead per shard job outside its runtime** (span - sum of runtimes) / (shards - 1) | **{run['overhead_per_job_s']:.2f}** |",
            f"| median gap between one shard's finish and the next one's start | {run['gap_median_s']:.2f} |",
            f"| (wall - sum of shard runtimes) / shards | {run['wall_minus_runtime_per_job_s']:.2f} |",
            f"| per shard, inside its runtime: model_load_seconds (torch/transformers imports + load), median | {run['model_load_median_s']:.2f} |",
            f"| per shard: inference_runtime_seconds, median | {run['inference_median_s']:.3f} |",
            f"| per shard: runtime_seconds, median | {run['runtime_median_s']:.2f} |",
        ]
    lines += (
        ["", "Figures (the script's last lines):", "", "```"]
        + [f"{k}: {v}" for k, v in figures(dry, parse, run, parsed, probe).items()]
        + ["```"]
    )
    return "\n".join(lines)


@contextlib.contextmanager
def workspace(args):
    """(root, tiny model, dataset of args.rows rows, the scontrol probe) in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="bench-snakemake-", dir=args.workdir) as tmp:
        root = Path(tmp)
        model = root / "tiny-llama"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
        dataset = root / "data.jsonl"
        write_dataset(dataset, args.rows)
        yield root, model, dataset, slurm_probe(root)


def job_parse_main(args, cmd: str, counts: list[int]) -> None:
    """Part 2 alone (--job-parse-only): minutes instead of the dry runs' hour at 30,000 shards."""
    load0 = os.getloadavg()[0]
    with workspace(args) as (root, model, dataset, probe):
        parse = job_parse(root, model, dataset, counts, args.repeats, args.floor_python)
    load1 = os.getloadavg()[0]
    info = machine("snakemake", "snakemake-executor-plugin-slurm", "snakemake-executor-plugin-slurm-jobstep")
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    body = "\n".join(
        [
            f"## Snakemake at scale: one cluster job's start, {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            "",
            f"Command: `{cmd}`",
            "",
            f"Machine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, {versions}; commit {git_rev()}; "
            f"load average {load0:.2f} at start, {load1:.2f} at end (shared machine: compare CPU times within this table). "
            f"Workflow: `{os.path.relpath(SNAKEFILE, REPO)}`; the section above has the rest of the benchmark. "
            f"Medians of {args.repeats} interleaved repeats."
            + (" `scontrol` stubbed as in the section above." if probe["stubbed"] else ""),
            "",
            *job_parse_lines(parse)[2:],
        ]
    )
    if not args.no_write:
        write_section(JOB_PARSE_SECTION, body)
    print(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1000,10000,30000", help="comma-separated shard counts for the dry runs and the job parse")
    ap.add_argument("--dry-modes", default="quiet,verbose", help=f"which dry runs: {', '.join(DRY_MODES)}")
    ap.add_argument("--parse-shards", default="1000,10000,100000", help="shard counts for the parse-only runs")
    ap.add_argument("--rows", type=int, default=20000, help="rows of the generated dataset (at least the largest shard count)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run-shards", type=int, default=50, help="shards of the local run (0: skip it)")
    ap.add_argument("--rows-per-shard", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--snakefile", type=Path, default=None, help="another copy of the workflow (before/after comparisons)")
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument(
        "--floor-python",
        type=Path,
        action="append",
        default=[],
        help="another environment's python (with snakemake and the SLURM plugins): its floor and imports too, for the job parse",
    )
    ap.add_argument(
        "--job-parse-only",
        action="store_true",
        help=f"only part 2 (one job's parse and the floor's parts), into BENCHMARKS.md's {JOB_PARSE_SECTION} section",
    )
    args = ap.parse_args()
    global SNAKEFILE
    SNAKEFILE = (args.snakefile or SNAKEFILE).resolve()
    cmd = "python scripts/bench/snakemake_scale.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    counts = [int(x) for x in args.shards.split(",") if x.strip()]
    parse_counts = [int(x) for x in args.parse_shards.split(",") if x.strip()]
    modes = [m for m in args.dry_modes.split(",") if m.strip()]
    if unknown := set(modes) - DRY_MODES.keys():
        ap.error(f"--dry-modes: unknown {sorted(unknown)} (known: {', '.join(DRY_MODES)})")
    args.rows = max(args.rows, *counts, *parse_counts)  # num_shards > rows is refused

    if args.job_parse_only:
        args.rows = max(args.rows, *counts)
        return job_parse_main(args, cmd, counts)

    load0 = os.getloadavg()[0]
    with workspace(args) as (root, model, dataset, probe):
        dry = dry_runs(root, model, dataset, counts, args.repeats, modes)
        parse = job_parse(root, model, dataset, counts, args.repeats, args.floor_python)
        parsed = parse_only(root, model, dataset, parse_counts, args.repeats)
        run = local_run(root, model, args.run_shards, args.rows_per_shard) if args.run_shards else None
    load1 = os.getloadavg()[0]
    if not args.no_write:
        write_section(
            SECTION,
            section(cmd, machine("snakemake", "snakemake-executor-plugin-slurm"), args, dry, parse, run, parsed, (load0, load1), probe),
        )
    for k, v in figures(dry, parse, run, parsed, probe).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
