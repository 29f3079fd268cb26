"""A/B of the per-row overhead: scripts/bench/pipeline_overhead.py from two checkouts, interleaved.

    python scripts/bench/ab_overhead.py ../base            # this checkout vs ../base, 3 rounds
    python scripts/bench/ab_overhead.py ../base --rounds 5 -- --rows 50000 --repeats 5

Each round runs the base checkout's pipeline_overhead.py, then this one's, with the same
arguments (default ``--no-mmirage --rows 20000 --repeats 3``; ``--no-write`` always), each
with its own ``src`` on PYTHONPATH. The medians of every variant's rows/s and rows per
CPU-second over all rounds are printed side by side with their ratio (new / base): noise
from other tenants of the machine hits both sides. Rows per CPU-second is the steadier
figure on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
LINE = re.compile(r"repeat \d+/\d+ (\S+): ([\d,]+) rows/s, ([\d,]+) rows/CPU-s")


def run(checkout: Path, args: list[str]) -> dict[str, list[tuple[int, int]]]:
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "scripts/bench/pipeline_overhead.py", *args, "--no-write"]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: pipeline_overhead.py failed:\n{proc.stderr[-3000:]}")
    out: dict[str, list[tuple[int, int]]] = {}
    for m in LINE.finditer(proc.stderr):
        out.setdefault(m.group(1), []).append((int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, help="the other checkout (e.g. a worktree of main)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("bench_args", nargs="*", help="after --: pipeline_overhead.py's arguments")
    # split at "--" here: argparse gives the empty bench_args to the first positional chunk
    # (the checkout), and then refuses what follows "--" as unrecognised
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    bench_args = bench_args or args.bench_args or ["--no-mmirage", "--rows", "20000", "--repeats", "3"]
    results: dict[str, dict[str, list]] = {"base": {}, "new": {}}
    for r in range(args.rounds):
        for side, checkout in (("base", args.base.resolve()), ("new", HERE)):
            for name, values in run(checkout, bench_args).items():
                results[side].setdefault(name, []).extend(values)
            print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr, flush=True)
    print("| variant | base rows/s | new rows/s | ratio | base rows/CPU-s | new rows/CPU-s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted(results["new"]):
        b, n = results["base"].get(name), results["new"][name]
        if not b:
            continue
        bw, nw = statistics.median(x[0] for x in b), statistics.median(x[0] for x in n)
        bc, nc = statistics.median(x[1] for x in b), statistics.median(x[1] for x in n)
        print(f"| {name} | {bw:,.0f} | {nw:,.0f} | {nw / bw:.2f} | {bc:,.0f} | {nc:,.0f} | {nc / bc:.2f} |")


if __name__ == "__main__":
    main()
