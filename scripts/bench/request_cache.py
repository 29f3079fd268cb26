"""What an edit costs: requests sent by a rerun, with and without the request cache.

    python scripts/bench/request_cache.py                  # 200 rows, 4 shards, 3 edits
    python scripts/bench/request_cache.py --rows 1000 --latency 0.02

The workflow runs as a user runs it (``python -m snakemake --configfile ... --cores 1``)
with the ``openai`` backend against the fake OpenAI-compatible server of the tests
(tests/fakes/fake_http.py, a thread of this process), which records every request it gets
and answers each after ``--latency`` seconds (a stand-in for generation time). The
pipeline: a JSONL of generated documents, two chained outputs (a summary of the text, then
a title of the summary), greedy (temperature 0), a record template using both.

For each edit, two fresh working directories run the same pipeline, then the edited one:
``cache`` with the default ``shard_params.request_cache: true``, ``no cache`` with it
false (every row of every rerun shard asks the engine again, as before the cache). The
edits:

- ``output_schema``: the record template changes (a new field from both outputs);
- ``second prompt``: the prompt of the second output changes;
- ``one row``: one row of the dataset is rewritten (its text).

Reported per edit and variant: the requests the rerun sent (counted by the server), the
requests taken from the cache (status.json), and the rerun's wall time; and the cache's
size on disk per answer, measured on this run's answers and on answers of ~1,000 bytes
(written through the cache itself), as bytes per 1M rows of one output.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

sys.path.insert(0, str(C.ROOT / "tests"))
from fakes.fake_http import Behaviour, FakeServer

from mirageflow.engines.wire import Completion
from mirageflow.shard import request_cache as rc

SHARDS = 4
LONG_ANSWER_BYTES = 1000  # ~200 tokens of English


def pipeline(server: FakeServer, cache: bool) -> dict:
    return {
        "processors": [{
            "type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "fake-model"},
            "default_sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "max_retries": 0, "request_timeout": 60,
        }],
        "loading_params": {
            "state_dir": "state", "num_shards": SHARDS,
            "datasets": [{"path": "rows.jsonl", "type": "jsonl", "output_dir": "out", "output_format": "jsonl"}],
        },
        "shard_params": {"request_cache": cache},
        "processing_params": {
            "inputs": [{"name": "title", "key": "title"}, {"name": "text", "key": "text"}],
            "outputs": [
                {"name": "summary", "prompt": "Summarise in one sentence: {{ text }}"},
                {"name": "headline", "prompt": "A headline for '{{ title }}' from this summary: {{ summary }}"},
            ],
            "output_schema": {"summary": "{{ summary }}", "headline": "{{ headline }}"},
        },
    }  # fmt: skip


def edit_schema(cfg: dict, root: Path) -> None:
    cfg["processing_params"]["output_schema"] = {
        "summary": "{{ summary }}",
        "headline": "{{ headline }}",
        "card": "{{ headline }}: {{ summary }}",
    }


def edit_second_prompt(cfg: dict, root: Path) -> None:
    cfg["processing_params"]["outputs"][1]["prompt"] = "A short headline for '{{ title }}' from this summary: {{ summary }}"


def edit_one_row(cfg: dict, root: Path) -> None:
    lines = (root / "rows.jsonl").read_text().splitlines()
    row = json.loads(lines[len(lines) // 2])
    row["text"] = "An edited passage: " + row["text"]
    lines[len(lines) // 2] = json.dumps(row)
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n")


EDITS = {"output_schema": edit_schema, "second prompt": edit_second_prompt, "one row": edit_one_row}


def snakemake(root: Path, cfg: dict) -> float:
    import yaml

    (root / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(C.ROOT / "Snakefile"), "--directory", str(root),
           "--configfile", str(root / "pipeline.yaml"), "--cores", "1"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed in {root}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return time.perf_counter() - t0


def shard_stats(root: Path) -> list[dict]:
    return [json.loads(p.read_text())["stats"] for p in sorted((root / "state").glob("shard_*/status.json"))]


def one_case(work: Path, server: FakeServer, rows: list[dict], edit, cache: bool) -> dict:
    root = Path(tempfile.mkdtemp(dir=work))
    C.write_jsonl(root / "rows.jsonl", rows)
    cfg = pipeline(server, cache)
    before = len(server.records)
    snakemake(root, cfg)
    first = len(server.records) - before
    edited = copy.deepcopy(cfg)
    edit(edited, root)
    before = len(server.records)
    seconds = snakemake(root, edited)
    stats = shard_stats(root)
    out = {
        "first_run_requests": first,
        "rerun_requests": len(server.records) - before,
        "rerun_cached": sum(s.get("requests_cached", 0) for s in stats),
        "rerun_seconds": seconds,
        "cache_bytes": sum((s.get("request_cache") or {}).get("bytes", 0) for s in stats),
        "cache_answers": sum((s.get("request_cache") or {}).get("answers_kept", 0) for s in stats),
    }
    shutil.rmtree(root)
    return out


def long_answer_bytes(work: Path, n: int = 10000) -> float:
    """Bytes on disk per kept answer of LONG_ANSWER_BYTES (the cache's own format)."""
    text = " ".join(C.make_rows(1, seed=1, words=(400, 400))[0]["text"].split())[:LONG_ANSWER_BYTES]
    cache = rc.RequestCache(work / "long")
    cache.restore()
    for i in range(n):
        key = rc.request_key("bench", rc.Request(i, None, f"prompt {i}", {"temperature": 0.0}, None))
        cache.put(key, Completion(i, text, 300, 200, "stop"))
    cache.commit()
    return cache.disk_bytes() / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--latency", type=float, default=0.01, help="seconds the server takes per request")
    ap.add_argument("--no-write", action="store_true", help="print, do not update BENCHMARKS.md")
    args = ap.parse_args()
    info = C.machine("snakemake")
    rows = C.make_rows(args.rows)
    server = FakeServer(Behaviour(latency=args.latency)).start()
    work = Path(tempfile.mkdtemp(prefix="bench-request-cache-"))
    results: dict[str, dict[str, dict]] = {}
    try:
        for name, edit in EDITS.items():
            for variant, cache in (("cache", True), ("no cache", False)):  # side by side, one edit at a time
                results.setdefault(name, {})[variant] = r = one_case(work, server, rows, edit, cache)
                print(f"{name:14s} {variant:9s} first run {r['first_run_requests']} requests; rerun {r['rerun_requests']} sent, "
                      f"{r['rerun_cached']} cached, {r['rerun_seconds']:.1f} s", flush=True)  # fmt: skip
        per_answer_run = results["output_schema"]["cache"]["cache_bytes"] / results["output_schema"]["cache"]["cache_answers"]
        per_answer_long = long_answer_bytes(work)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    table = []
    for name, variants in results.items():
        c, n = variants["cache"], variants["no cache"]
        table.append([name, c["first_run_requests"], c["rerun_requests"], c["rerun_cached"], n["rerun_requests"],
                      f"{c['rerun_seconds']:.1f}", f"{n['rerun_seconds']:.1f}", f"{n['rerun_seconds'] / c['rerun_seconds']:.2f}"])  # fmt: skip
    figures = {
        **{f"{name.replace(' ', '_')}_rerun_requests_cache": v["cache"]["rerun_requests"] for name, v in results.items()},
        **{f"{name.replace(' ', '_')}_rerun_requests_no_cache": v["no cache"]["rerun_requests"] for name, v in results.items()},
        "cache_bytes_per_answer_this_run": per_answer_run,
        "cache_bytes_per_answer_1000_byte_answers": per_answer_long,
        "cache_gb_per_million_rows_per_output_1000_byte_answers": per_answer_long * 1e6 / 1e9,
    }
    cmd = (
        "python scripts/bench/request_cache.py"
        + (f" --rows {args.rows}" if args.rows != 200 else "")
        + (f" --latency {args.latency}" if args.latency != 0.01 else "")
    )
    body = f"""## Request cache: what an edit costs (`scripts/bench/request_cache.py`)

The workflow as a user runs it (`python -m snakemake --cores 1`), the `openai` backend against
the tests' fake OpenAI-compatible server (tests/fakes/fake_http.py), which counts every request
and answers each after {args.latency * 1000:.0f} ms. {args.rows} generated rows, {SHARDS} shards, two chained outputs
(a summary, then a headline of the summary), temperature 0. Per edit, two fresh directories run
the pipeline and then the edited one: `cache` (default `shard_params.request_cache: true`) and
`no cache` (`request_cache: false`: every row of every rerun shard asks again). Requests are the
server's count; cached is status.json's `requests_cached` summed over the shards.

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{C.table(["edit", "first run: requests", "rerun, cache: requests sent", "rerun, cache: answers from the cache", "rerun, no cache: requests sent", "rerun wall s, cache", "rerun wall s, no cache", "no cache / cache"], table)}

The rerun's wall time includes Snakemake's start and one shard job per shard (each loads
its engine: for `openai`, nothing); the requests are the cost that grows with a real model.

Cache size on disk: {per_answer_run:.0f} bytes per kept answer with this run's short answers
(at most 8 words), {per_answer_long:.0f} bytes per answer of {LONG_ANSWER_BYTES:,} bytes (a 64-hex key, the
counts and finish reason, the text as JSON): **{per_answer_long * 1e6 / 1e9:.2f} GB per 1M rows per LLM output**
with ~1,000-byte (~200-token) answers, i.e. about the answers' own size plus ~{per_answer_long - LONG_ANSWER_BYTES:.0f} bytes each.
A shard holds its own cache in memory while it runs (about the same size).

Figures:

```
{chr(10).join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in figures.items())}
```
"""
    if not args.no_write:
        C.write_section("request_cache", body)
    C.print_figures(figures)


if __name__ == "__main__":
    main()
