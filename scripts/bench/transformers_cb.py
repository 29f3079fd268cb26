"""Continuous batching vs static batches in the transformers engine, on the CPU, through the shard runner.

    python scripts/bench/transformers_cb.py             # tiny model + SmolLM2, writes BENCHMARKS.md
    python scripts/bench/transformers_cb.py --models tiny --no-write

The same pipeline (chat-templated prompts of 6-30 words, greedy, float32, one torch
thread) runs through ``mirageflow.shard.runner.run_shard`` twice per repeat, alternating:

- static: ``extra_engine_args.continuous_batching: false``: left-padded ``generate`` batches
  of ``--batch-size`` rows; a batch decodes until its longest row ends.
- continuous: ``continuous_batching: true``: transformers' continuous-batching manager
  (paged KV cache) with ``max_running_requests`` = ``--batch-size``, so both sides decode
  at most the same number of rows at once; a row that ends frees its slot.

Tokens/s = completion tokens over the runner's generation window (status.json
``tokens_per_sec``); medians over ``--repeats``; the ratio is continuous/static. The
tiny random model answers up to the length limit on every row (uniform lengths: only the
manager's own cost shows); SmolLM2 stops at its EOS (varied lengths: what a static batch
wastes on its finished rows shows). The texts of the two sides are compared row by row.

Printed last, one per line, ``name: value``; the ``transformers_cb`` section of
BENCHMARKS.md is regenerated.
"""

from __future__ import annotations

from _common import git_rev, machine, shard_answers, transformers_processor, write_section

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import datetime as dt
import json
import logging
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from cpu_engine import make_texts, smollm2_model, tiny_model

SECTION = "transformers_cb"


def config(model: Path, jsonl: Path, root: Path, batch_size: int, new_tokens: int, continuous: bool) -> dict:
    processor = transformers_processor(model, new_tokens)
    processor["server_args"]["extra_engine_args"] = {"continuous_batching": continuous, "max_running_requests": batch_size}
    return {
        "processors": [processor],
        "loading_params": {
            "state_dir": str(root / "state"),
            "datasets": [{"path": str(jsonl), "type": "JSONL", "output_dir": str(root / "out"), "output_format": "jsonl"}],
            "num_shards": 1,
            "batch_size": batch_size,
        },
        "processing_params": {
            "inputs": [{"name": "i", "key": "i"}, {"name": "text", "key": "text"}],
            "outputs": [{"name": "answer", "type": "llm", "output_type": "plain", "prompt": "{{ text }}"}],
            "remove_columns": True,
            "output_schema": {"i": "{{ i }}", "answer": "{{ answer }}"},
        },
    }


def run(model: Path, texts: list[str], root: Path, batch_size: int, new_tokens: int, continuous: bool) -> dict:
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets, run_shard

    root.mkdir(parents=True)
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"i": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    cfg = load_config(config(model, jsonl, root, batch_size, new_tokens, continuous))
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    st = status["stats"]
    cb = status["engines"]["llm"]["details"]["continuous_batching"]
    if cb["enabled"] != continuous or (continuous and cb["requests"] != len(texts)):
        raise SystemExit(f"the engine did not run as asked (continuous={continuous}): {cb}")
    rows = shard_answers(root)
    lengths = st.get("output_tokens_per_row_hist") or {}
    return {
        "tok_s": st["output_tokens"] / st["inference_runtime_seconds"],
        "rows_s": len(texts) / st["inference_runtime_seconds"],
        "tokens": st["output_tokens"],
        "window_s": st["inference_runtime_seconds"],
        "texts": [rows.get(i) for i in range(len(texts))],
        "failed": st["rows_failed"],
        "lengths": lengths,
    }


def bench(name: str, model: Path, n: int, batch_size: int, new_tokens: int, repeats: int, work: Path) -> dict:
    texts = make_texts(n)
    runs: dict[str, list] = {"static": [], "continuous": []}
    for r in range(repeats):
        for side in ("static", "continuous") if r % 2 == 0 else ("continuous", "static"):
            runs[side].append(run(model, texts, work / f"{name}-{side}-{r}", batch_size, new_tokens, side == "continuous"))
        print(f"[{name}] repeat {r + 1}/{repeats}: static {runs['static'][-1]['tok_s']:.1f} tok/s, "
              f"continuous {runs['continuous'][-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
    med = {side: {k: statistics.median(x[k] for x in rs) for k in ("tok_s", "rows_s", "window_s", "tokens")} for side, rs in runs.items()}
    same = sum(a == b for a, b in zip(runs["static"][0]["texts"], runs["continuous"][0]["texts"]))
    return {
        "prompts": n,
        "static": med["static"],
        "continuous": med["continuous"],
        "tok_ratio": med["continuous"]["tok_s"] / med["static"]["tok_s"],
        "rows_ratio": med["continuous"]["rows_s"] / med["static"]["rows_s"],
        "paired_tok_ratio": statistics.median(c["tok_s"] / s["tok_s"] for s, c in zip(runs["static"], runs["continuous"])),
        "same_text": same,
        "failed": max(x["failed"] for rs in runs.values() for x in rs),
        "all_static": [round(x["tok_s"], 1) for x in runs["static"]],
        "all_continuous": [round(x["tok_s"], 1) for x in runs["continuous"]],
    }


def figures(results: dict) -> dict:
    out = {}
    for name, r in results.items():
        out[f"{name}_static_tok_s"] = round(r["static"]["tok_s"], 1)
        out[f"{name}_continuous_tok_s"] = round(r["continuous"]["tok_s"], 1)
        out[f"{name}_identical_texts"] = f"{r['same_text']}/{r['prompts']}"
        out[f"{name}_continuous_vs_static_rows_per_s"] = round(r["rows_ratio"], 3)
        out[f"{name}_continuous_vs_static_tok_s"] = round(r["tok_ratio"], 3)
    return out


def section(cmd: str, info: dict, args, results: dict, load: tuple) -> str:
    lines = [
        "## transformers engine: continuous batching vs static batches (CPU)",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, torch {info['versions']['torch']}, "
        f"transformers {info['versions']['transformers']}; commit {git_rev()}; "
        f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; load average {load[0]:.2f} at start, "
        f"{load[1]:.2f} at end (shared machine).",
        "",
        f"The same pipeline through the shard runner, alternating: static = `continuous_batching: false` (left-padded "
        f"`generate` batches of {args.batch_size}), continuous = `continuous_batching: true` (transformers' "
        f"continuous-batching manager, `max_running_requests` {args.batch_size}). Greedy, max_new_tokens "
        f"{args.new_tokens}, float32, one torch thread; tokens/s = completion tokens / the runner's generation window; "
        f"medians of {args.repeats} repeats. The tiny random model answers to the length limit on every row (uniform "
        "lengths); SmolLM2 stops at its EOS (varied lengths).",
        "",
        "| model | prompts | static tok/s | continuous tok/s | **continuous/static tok/s** | rows/s ratio | tokens (static / continuous) | identical texts | failed rows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s, c = r["static"], r["continuous"]
        lines.append(
            f"| {name} | {r['prompts']} | {s['tok_s']:.1f} | {c['tok_s']:.1f} | **{r['tok_ratio']:.3f}** | {r['rows_ratio']:.3f} | "
            f"{s['tokens']:.0f} / {c['tokens']:.0f} | {r['same_text']}/{r['prompts']} | {r['failed']} |"
        )
    lines += ["", "Every repeat (tok/s):", ""]
    for name, r in results.items():
        lines.append(f"- {name}: static {r['all_static']}, continuous {r['all_continuous']}")
    lines += ["", "Figures (the script's last lines):", "", "```"] + [f"{k}: {v}" for k, v in figures(results).items()] + ["```"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--prompts-tiny", type=int, default=256)
    ap.add_argument("--prompts-smollm2", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = ap.parse_args()
    cmd = "python scripts/bench/transformers_cb.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-transformers-cb-", dir=args.workdir) as tmp:
        work = Path(tmp)
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name == "tiny":
                model, n = tiny_model(work), args.prompts_tiny
            elif name == "smollm2":
                model, n = smollm2_model(work), args.prompts_smollm2
            else:
                raise SystemExit(f"unknown model {name!r} (tiny, smollm2)")
            results[name] = bench(name, model, n, args.batch_size, args.new_tokens, args.repeats, work)
    load1 = os.getloadavg()[0]
    if not args.no_write:
        write_section(SECTION, section(cmd, machine("torch", "transformers"), args, results, (load0, load1)))
    for k, v in figures(results).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
