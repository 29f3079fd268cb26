"""Static batches sized by time (engines/batch_time.py): what a stop loses, and what it costs.

    python scripts/bench/batch_time.py                        # SmolLM2, writes BENCHMARKS.md
    python scripts/bench/batch_time.py --requests 8 --tokens 32 --no-write

The case of issue 34 item 5: a shard's requests (``--requests``, default 28: 14 rows x 2
samples) all run to the same limit (``ignore_eos``, greedy, ``--tokens`` new tokens each) on
the transformers engine's static path with ``batch_size`` 32, so an uncapped engine returns
them all at the end of one batch. Each side is one TransformersEngine on SmolLM2-135M-Instruct
(one torch thread) given all requests at once, as the shard runner's in-flight window does:

- uncapped: ``commit_seconds`` None (no runner: what every engine did before);
- capped: ``commit_seconds`` = ``--commit-seconds`` (the runner's checkpoint_seconds), so each
  batch is sized to end within half of it.

Figures, medians over ``--repeats`` alternating runs: the first answer's arrival (s), the
longest stretch with no answer back (s: the work a stop at the worst moment loses), and
tokens/s over the whole set. The ratio capped/uncapped of tokens/s is printed last.
"""

from __future__ import annotations

from _common import fmt, git_rev, machine, machine_lines, median, now, print_figures, table, write_section

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import asyncio
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "batch_time"
SMOLLM2_DIR = REPO / "resources" / "models" / "SmolLM2-135M-Instruct"


def run_once(model: Path, requests: int, tokens: int, commit_seconds: float | None) -> dict:
    from mirageflow.config import ServerArgs
    from mirageflow.engines.transformers_engine import TransformersEngine
    from mirageflow.engines.wire import Request

    engine = TransformersEngine(ServerArgs(str(model)), batch_size=32, torch_threads=1)
    engine.commit_seconds = commit_seconds
    engine.load()
    params = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    prompts = [engine.chat_prompt([{"role": "user", "content": f"Write a long story about topic {i}."}], {}) for i in range(requests)]

    async def main():
        start = time.perf_counter()
        arrivals = []

        async def one(i):
            c = await engine.generate_one(Request(i, None, prompts[i], params))
            arrivals.append(time.perf_counter() - start)
            return c

        done = await asyncio.gather(*(one(i) for i in range(requests)))
        return done, sorted(arrivals), time.perf_counter() - start

    try:
        done, arrivals, wall = asyncio.run(main())
    finally:
        engine.close()
    gaps = [b - a for a, b in zip([0.0] + arrivals, arrivals)]
    return {
        "first": arrivals[0],
        "longest_gap": max(gaps),
        "tok_s": sum(c.completion_tokens for c in done) / wall,
        "batch_time": engine.info.details["batch_time"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=SMOLLM2_DIR)
    ap.add_argument("--requests", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--commit-seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    info = machine("torch", "transformers")
    sides = {"uncapped": None, "capped": args.commit_seconds}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.repeats):
        for name in sides if r % 2 == 0 else reversed(sides):
            runs[name].append(run_once(args.model, args.requests, args.tokens, sides[name]))
            print(name, {k: v for k, v in runs[name][-1].items() if k != "batch_time"}, flush=True)
    figures = {}
    for name in sides:
        for key in ("first", "longest_gap", "tok_s"):
            figures[f"{name}_{key}"] = median([x[key] for x in runs[name]])
    figures["tok_s_ratio_capped_over_uncapped"] = figures["capped_tok_s"] / figures["uncapped_tok_s"]
    if not args.no_write:
        rows = [
            [name, fmt(figures[f"{name}_first"], 1), fmt(figures[f"{name}_longest_gap"], 1), fmt(figures[f"{name}_tok_s"], 1),
             ", ".join(fmt(x["tok_s"], 1) for x in runs[name])]
            for name in sides
        ]  # fmt: skip
        body = (
            "## transformers static batches sized by time: what a stop loses (CPU)\n\n"
            f"Command: `python scripts/bench/batch_time.py --requests {args.requests} --tokens {args.tokens} "
            f"--commit-seconds {args.commit_seconds} --repeats {args.repeats}` ({now()}, {git_rev()})\n\n"
            f"{args.requests} requests that all run to {args.tokens} new tokens (ignore_eos, greedy) on SmolLM2-135M-Instruct, "
            "batch_size 32, one torch thread; capped = the shard runner's commit interval given to the engine "
            f"({args.commit_seconds:g} s: batches sized to end within {args.commit_seconds / 2:g} s). "
            '"Longest wait" is the longest stretch with no answer back: what a stop at the worst moment loses.\n\n'
            + table(["side", "first answer (s)", "longest wait (s)", "tok/s (median)", "every repeat (tok/s)"], rows)
            + f"\nThroughput ratio capped/uncapped: **{figures['tok_s_ratio_capped_over_uncapped']:.2f}**.\n\n"
            + machine_lines(info)
        )
        write_section(SECTION, body)
    print_figures(figures)


if __name__ == "__main__":
    main()
