"""Engine feeding efficiency: does the runner keep a continuous-batching engine full?

    python scripts/bench/engine_feeding.py          # ~40 s
    python scripts/bench/engine_feeding.py --requests 8000 --baseline-requests 768   # quicker

A simulated continuous-batching engine (``_engines.SimulatedBatchEngine``, our Engine
interface): up to C=256 sequences run at once, every decode step takes a fixed time and
gives each running sequence one token, waiting requests join at the next step. Output
lengths are heavy-tailed (lognormal, capped at max_new_tokens) and fixed per request, so
both feeders ask for exactly the same work.

- ours: the real ``ShardRunner`` (``run_shard``) over a JSONL of the requests, with the
  engine's own in-flight window (2 x C) and the tiny model's chat template;
- ours + Python step: the same, with a custom step (mirageflow.shard.steps.python: a Python
  function per row in ``--python-step-workers`` worker processes, each call also sleeping
  ``--python-step-ms``) in the row path before the LLM output, whose prompt uses its value: the
  engine can only be fed as fast as the step delivers;
- baseline: MMIRAGE's pattern, one blocking call per batch of 64 (render 64 prompts,
  submit them, wait for all 64, then the next batch), on the first ``--baseline-requests``
  of the same requests (it is ~20x slower; a rate needs no more).

Fraction of ideal = achieved tokens/s / ideal tokens/s, where ideal = C tokens per step
(the engine always full): tokens * step_seconds / (C * window), the window running from
the first request to the last completion. Step occupancy (tokens / (steps * C)) is the same
ratio counted in engine steps, immune to timer jitter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
from _engines import SimulatedBatchEngine


class TimedEngine(SimulatedBatchEngine):
    """Records the generation window: first request in, last completion out."""

    t_first = t_last = None
    completions = 0

    async def generate_one(self, request):
        if self.t_first is None:
            self.t_first = time.monotonic()
        c = await super().generate_one(request)
        self.t_last = time.monotonic()
        self.completions += 1
        return c


def lengths_for(n: int, median: float, sigma: float, cap: int, seed: int) -> dict[int, int]:
    rng = random.Random(seed)
    return {i: max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma)))) for i in range(n)}


# The Python step of "ours + Python step": a little string work, and --python-step-ms of waiting
# (an I/O call, a lookup) that the worker processes overlap.
STEP_SCRIPT = """import time

def passage(v):
    time.sleep({seconds})
    return " ".join(v["text"].split())
"""


def config(data: Path, work: Path, tokenizer: str, cap: int, step: tuple[float, int] | None = None) -> dict:
    """``step``: (seconds, workers) of a custom step before the LLM output, else none."""
    processors = [
        {"type": "llm", "server_args": {"model_path": tokenizer}, "default_sampling_params": {"temperature": 0.7, "max_new_tokens": cap}}
    ]
    outputs = [{"name": "answer", "prompt": "Answer the question about this passage: {{ text }}"}]
    if step is not None:
        work.mkdir(parents=True, exist_ok=True)
        (work / "step.py").write_text(STEP_SCRIPT.format(seconds=step[0]))
        processors.append({"type": "custom", "script_path": str(work / "step.py"), "function_name": "passage", "max_workers": step[1]})
        outputs = [{"name": "clean", "type": "custom"}, {"name": "answer", "prompt": "Answer the question about this passage: {{ clean }}"}]
    return {
        "processors": processors,
        "loading_params": {
            "state_dir": str(work / "state"),
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(work / "out")}],
            "num_shards": 1,
        },
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": outputs,
            "remove_columns": True,
            "output_schema": {"answer": "{{ answer }}"},
        },
    }


def summarise(engine: TimedEngine, capacity: int, step: float) -> dict:
    window = engine.t_last - engine.t_first
    ideal_steps = engine.tokens / capacity
    return {
        "requests": engine.completions,
        "tokens": engine.tokens,
        "window_s": window,
        "steps": engine.steps,
        "ideal_steps": ideal_steps,
        "tokens_per_sec": engine.tokens / window,
        "ideal_tokens_per_sec": capacity / step,
        "fraction_of_ideal": engine.tokens * step / (capacity * window),
        "step_occupancy": engine.tokens / (engine.steps * capacity),
        # until the last request joined: how full the feeder kept the engine, before the drain
        "occupancy_while_fed": engine.tokens_fed / (engine.steps_fed * capacity) if engine.steps_fed else None,
        "drain_steps": engine.steps - engine.steps_fed,
    }


def run_ours(rows, lengths, args, tokenizer, work: Path, python_step: bool = False) -> dict:
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets, run_shard

    data = C.write_jsonl(work / "data.jsonl", rows)
    if python_step:
        work = work / "python_step"
    step = (args.python_step_ms / 1000, args.python_step_workers) if python_step else None
    cfg = load_config(config(data, work, tokenizer, args.max_new_tokens, step))
    index_datasets(cfg)
    engine = TimedEngine(lengths, capacity=args.capacity, step_seconds=args.step_ms / 1000, tokenizer_path=tokenizer, chat="fast")
    status = run_shard(cfg, 0, engine_factory=lambda *a, **k: engine)
    assert status["stats"]["rows_processed"] == len(rows), status["stats"]
    out = summarise(engine, args.capacity, args.step_ms / 1000)
    out["runner_inference_runtime_s"] = status["stats"]["inference_runtime_seconds"]
    return out


def run_baseline(rows, lengths, args, tokenizer, work: Path) -> dict:
    """One blocking call per batch of 64: the same prompts, the same engine."""
    from mirageflow.config import load_config
    from mirageflow.engines.wire import Request
    from mirageflow.prompts.templates import Extractor, PromptBuilder

    data = C.write_jsonl(work / "data_baseline.jsonl", rows)
    cfg = load_config(config(data, work / "baseline", tokenizer, args.max_new_tokens))
    engine = TimedEngine(lengths, capacity=args.capacity, step_seconds=args.step_ms / 1000, tokenizer_path=tokenizer, chat="fast")
    engine.load()
    extract, builder = Extractor(cfg.inputs), PromptBuilder(cfg.outputs[0])
    sampling = cfg.processors["llm"].sampling_params

    async def main():
        for start in range(0, len(rows), args.batch):
            batch = []
            for i in range(start, min(start + args.batch, len(rows))):
                messages = builder.messages(extract(rows[i]))
                batch.append(Request(i, messages, engine.chat_prompt(messages, {}), sampling))
            await asyncio.gather(*(engine.generate_one(r) for r in batch))  # wait for the whole batch

    asyncio.run(main())
    return summarise(engine, args.capacity, args.step_ms / 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30_000)
    ap.add_argument("--baseline-requests", type=int, default=1024, help="prefix of the same requests for the batch-barrier baseline")
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--median-tokens", type=float, default=64)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--python-step-ms", type=float, default=1.0, help="what each call of the Python step waits (ours + Python step)")
    ap.add_argument("--python-step-workers", type=int, default=4, help="the Python step's worker processes (max_workers)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from pipeline_overhead import tiny_model

    tokenizer = tiny_model()
    info = C.machine("mirageflow", "transformers", "jinja2")
    rows = C.make_rows(args.requests, seed=args.seed, words=(10, 30))
    lengths = lengths_for(args.requests, args.median_tokens, args.sigma, args.max_new_tokens, args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-feeding-"))
    try:
        t0 = time.monotonic()
        ours = run_ours(rows, lengths, args, tokenizer, work)
        print(f"ours: {json.dumps(ours)}", file=sys.stderr, flush=True)
        stepped = run_ours(rows, lengths, args, tokenizer, work, python_step=True)
        print(f"ours + Python step: {json.dumps(stepped)}", file=sys.stderr, flush=True)
        nb = min(args.baseline_requests, args.requests)
        base = run_baseline(rows[:nb], lengths, args, tokenizer, work)
        print(f"baseline: {json.dumps(base)}", file=sys.stderr, flush=True)
        wall = time.monotonic() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lens = sorted(lengths.values())
    figures = {
        "ours_fraction_of_ideal": ours["fraction_of_ideal"],
        "baseline_fraction_of_ideal": base["fraction_of_ideal"],
        "ours_step_occupancy": ours["step_occupancy"],
        "baseline_step_occupancy": base["step_occupancy"],
        "ours_occupancy_while_fed": ours["occupancy_while_fed"],
        "ours_python_step_fraction_of_ideal": stepped["fraction_of_ideal"],
        "ours_python_step_occupancy_while_fed": stepped["occupancy_while_fed"],
        "baseline_occupancy_while_fed": base["occupancy_while_fed"],
        "ours_tokens_per_sec": ours["tokens_per_sec"],
        "baseline_tokens_per_sec": base["tokens_per_sec"],
        "ideal_tokens_per_sec": ours["ideal_tokens_per_sec"],
    }
    if not args.no_write:
        cmd = "python scripts/bench/engine_feeding.py" + "".join(f" {a}" for a in sys.argv[1:])
        rows_md = [
            [
                name,
                r["requests"],
                f"{r['tokens']:,}",
                f"{r['window_s']:.2f}",
                r["steps"],
                f"{r['ideal_steps']:.0f}",
                r["drain_steps"],
                f"{r['tokens_per_sec']:,.0f}",
                f"{r['fraction_of_ideal']:.3f}",
                f"{r['step_occupancy']:.3f}",
                f"{r['occupancy_while_fed']:.3f}",
            ]
            for name, r in (
                ("ours (ShardRunner, window 2 x C)", ours),
                (f"ours + Python step ({args.python_step_workers} workers, {args.python_step_ms:g} ms wait a call)", stepped),
                ("baseline (blocking batches of 64)", base),
            )
        ]
        body = f"""## Engine feeding efficiency (`scripts/bench/engine_feeding.py`)

A simulated continuous-batching engine (capacity C = {args.capacity} sequences, {args.step_ms} ms per decode
step for all running sequences; output lengths lognormal, median {args.median_tokens:g}, sigma {args.sigma},
capped at {args.max_new_tokens}: mean {sum(lens) / len(lens):.0f}, p99 {lens[int(0.99 * len(lens))]}, {sum(1 for x in lens if x == args.max_new_tokens)} rows at the cap) fed by
our `ShardRunner` over {args.requests:,} requests and by a batch-barrier baseline (one blocking
call per batch of {args.batch}, as MMIRAGE does) over the first {min(args.baseline_requests, args.requests):,} of the same requests.
"ours + Python step" is our runner with a custom step in the row path before the LLM output
(a Python function per row in {args.python_step_workers} worker processes, each call also waiting {args.python_step_ms:g} ms; the
prompt uses its value), so every request waits for it: whether the engine stays fed while
Python steps run.
Ideal = the engine always full = {figures["ideal_tokens_per_sec"]:,.0f} tokens/s. Fraction of ideal =
tokens * step / (C * window from first request to last completion); step occupancy =
tokens / (steps run * C). The end of a run, when the last long sequences finish alone
(the drain, after the last request joined), counts against both; the last column leaves it out.

- command: `{cmd}` ({wall:.0f} s wall)
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{C.table(["feeder", "requests", "tokens", "window s", "steps", "ideal steps", "drain steps", "tokens/s", "fraction of ideal", "step occupancy", "occupancy until the last request joined"], rows_md)}

Figures:

```
{chr(10).join(f"{k}: {v:.3f}" if v < 10 else f"{k}: {v:.0f}" for k, v in figures.items())}
```
"""
        C.write_section("engine_feeding", body)
    C.print_figures(figures)


if __name__ == "__main__":
    main()
