"""SGLang engine benchmark (GPU): our pipeline (shard runner + ``backend: sglang``) vs a bare
``sglang.Engine`` loop on the same prompts.

    python scripts/bench/sglang_engine.py --model resources/models/SmolLM2-135M-Instruct
    python scripts/bench/sglang_engine.py --model DIR --prompts 1024 --new-tokens 128 --no-write --check-answer

Both sides get the same chat-templated prompts as the same token ids (one BOS,
``base.PromptTokenizer``), the same sampling (greedy, ``--new-tokens``) and the same engine
arguments (``sglang_common.engine_kwargs`` of one server_args: tp 1, dp 1,
``max_running_requests``, ``mem_fraction_static``, ``context_length``):

- ours: ``mirageflow.shard.runner.run_shard`` on a JSONL of the prompts (rows -> prompts -> the
  runner's in-flight window of 2 x max_running_requests -> ``SGLangEngine`` ->
  records, checkpoints, stats: true). Output tokens/s = status.json ``tokens_per_sec``
  (output tokens over the generation window: model load excluded).
- bare: ``sglang.Engine(**same kwargs).generate(input_ids=all prompts, sampling_params)``,
  one call, SGLang's offline ideal. Output tokens/s = completion tokens / that call's wall time.

Each side runs in its own process (one SGLang engine per process), ours first; neither
is warmed up beyond what SGLang does at start. The ratio ours/bare is printed last
(target >= 0.95). Row 0 asks the capital of France: with ``--check-answer`` (a real
model) both answers must say Paris, else the script fails. The ours side's status.json
stays in ``--workdir`` (``WORKDIR/ours/state/shard_0/status.json``, for
scripts/bench/roofline.py --status). Without a GPU and sglang the sides fail with SGLang's
own error.
"""

from __future__ import annotations

from _common import git_rev, machine, shard_answers, write_section

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "sglang_engine"
QUESTION = "What is the capital of France? Answer in one word."


WORDS = (
    "river mountain data model token batch engine shard cluster passage summary city history science music "
    "garden ocean forest energy market language school travel bridge window computer planet winter harvest"
).split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Row 0 the capital question, then deterministic requests of 6-30 words (varied lengths)."""
    import random

    rng = random.Random(seed)
    words = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30))) for _ in range(n - 1)]
    return [QUESTION, *(f"Write one sentence about item {i}: {w}." for i, w in enumerate(words, 1))]


def server_args(args) -> dict:
    return {
        "model_path": str(args.model), "tp_size": 1, "dp_size": 1,
        "extra_engine_args": {"max_running_requests": args.max_running, "mem_fraction_static": args.mem_fraction,
                              "context_length": args.context_length, "log_level": "warning"},
    }  # fmt: skip


def sampling(args) -> dict:
    return {"temperature": 0.0, "max_new_tokens": args.new_tokens}


# --------------------------------------------------------------------------- the two sides (subprocesses)


def pipeline_config(args, texts: list[str], root: Path):
    """Our pipeline on the prompts; the bare side takes its server_args (defaults filled) too."""
    from mirageflow.config import load_config

    root.mkdir(parents=True, exist_ok=True)
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"i": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return load_config({
        "stats": True,
        "processors": [{"type": "llm", "backend": "sglang", "server_args": server_args(args), "default_sampling_params": sampling(args)}],
        "loading_params": {
            "state_dir": str(root / "state"), "num_shards": 1, "batch_size": args.max_running,
            "datasets": [{"path": str(jsonl), "type": "JSONL", "output_dir": str(root / "out"), "output_format": "jsonl"}],
        },
        "processing_params": {
            "inputs": [{"name": "i", "key": "i"}, {"name": "text", "key": "text"}],
            "outputs": [{"name": "answer", "type": "llm", "output_type": "plain", "prompt": "{{ text }}"}],
            "remove_columns": True,
            "output_schema": {"i": "{{ i }}", "answer": "{{ answer }}"},
        },
    })  # fmt: skip


def side_ours(args, texts: list[str], root: Path) -> dict:
    from mirageflow.shard.runner import index_datasets, run_shard

    cfg = pipeline_config(args, texts, root)
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    st = status["stats"]
    rows = shard_answers(root)
    (engine,) = status["engines"].values()
    return {
        "tok_s": st["tokens_per_sec"], "tokens": st["output_tokens"], "seconds": st["inference_runtime_seconds"],
        "rows_failed": st["rows_failed"], "peak_inflight": st["peak_inflight"], "load_s": st["model_load_seconds"],
        "prompt_input": engine["details"].get("prompt_input"), "sglang": engine["versions"].get("sglang"),
        "device": engine.get("device"), "texts": [rows.get(i) for i in range(len(texts))],
        "status_json": str(root / "state" / "shard_0" / "status.json"),
    }  # fmt: skip


def side_bare(args, texts: list[str], root: Path) -> dict:
    import sglang
    from transformers import AutoTokenizer

    from mirageflow.engines.tokens import PromptTokenizer
    from mirageflow.engines.sglang_common import engine_kwargs

    tok = AutoTokenizer.from_pretrained(str(args.model))
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    ids = PromptTokenizer(tok).batch(prompts)
    t0 = time.perf_counter()
    (processor,) = pipeline_config(args, texts, root).processors.values()
    engine = sglang.Engine(**engine_kwargs(processor.server_args, environ={}))  # what SGLangEngine passes
    load = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=sampling(args))
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in out)
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "load_s": load, "texts": [o["text"] for o in out]}


def run_side(name: str, args, work: Path) -> dict:
    """One side in a fresh process; its result comes back as a JSON file."""
    result = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--side", name, "--result", str(result), "--model", str(args.model),
           "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--max-running", str(args.max_running),
           "--mem-fraction", str(args.mem_fraction), "--context-length", str(args.context_length), "--workdir", str(work)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"the {name} side failed (exit {proc.returncode}); its output is above")
    out = json.loads(result.read_text())
    out["process_s"] = time.perf_counter() - t0
    print(
        f"[{name}] {out['tok_s']:.1f} output tok/s ({out['tokens']} tokens in {out['seconds']:.2f} s; process {out['process_s']:.0f} s)",
        file=sys.stderr,
    )
    return out


# --------------------------------------------------------------------------- report


def figures(ours: dict, bare: dict, n: int) -> dict:
    same = sum(a == b for a, b in zip(ours["texts"], bare["texts"]))
    return {
        "sglang_version": ours["sglang"],
        "device": ours["device"],
        "prompt_input": ours["prompt_input"],
        "ours_tok_s": round(ours["tok_s"], 1),
        "bare_tok_s": round(bare["tok_s"], 1),
        "ours_output_tokens": ours["tokens"],
        "bare_output_tokens": bare["tokens"],
        "ours_rows_failed": ours["rows_failed"],
        "ours_peak_inflight": ours["peak_inflight"],
        "identical_texts": f"{same}/{n}",
        "answer_row0_ours": json.dumps(ours["texts"][0]),
        "answer_row0_bare": json.dumps(bare["texts"][0]),
        "sglang_pipeline_vs_bare_ratio": round(ours["tok_s"] / bare["tok_s"], 3),
    }


def section(cmd: str, args, figs: dict, ours: dict, bare: dict) -> str:
    info = machine("sglang", "torch", "transformers")
    lines = [
        "## SGLang engine: shard runner + backend sglang vs a bare `sglang.Engine` loop",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {figs['device']}, {info['nproc']} CPUs, Python {info['python']}, sglang {figs['sglang_version']}, "
        f"torch {info['versions']['torch']}; commit {git_rev()}; {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        f"Setup: model {args.model.name}, {args.prompts} chat-templated prompts (token ids, one BOS), greedy, max_new_tokens "
        f"{args.new_tokens}, max_running_requests {args.max_running} (our window: twice that), mem_fraction_static "
        f"{args.mem_fraction}, one run per side, each in its own process. Ours = status.json `tokens_per_sec` (output tokens "
        "over the generation window); bare = completion tokens / the wall time of one `Engine.generate` call on all prompts.",
        "",
        "| side | output tok/s | output tokens | generation s | engine start s |",
        "|---|---|---|---|---|",
        f"| ours | {ours['tok_s']:.1f} | {ours['tokens']} | {ours['seconds']:.2f} | {ours['load_s']:.1f} |",
        f"| bare | {bare['tok_s']:.1f} | {bare['tokens']} | {bare['seconds']:.2f} | {bare['load_s']:.1f} |",
        "",
        "Figures (the script's last lines):",
        "",
        "```",
        *[f"{k}: {v}" for k, v in figs.items()],
        "```",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a local HF model directory")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-running", type=int, default=256, help="SGLang max_running_requests, both sides")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="SGLang mem_fraction_static, both sides")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--check-answer", action="store_true", help="fail unless both sides answer row 0 with Paris (a real model)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory, kept (default: a temporary one, removed)")
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--side", choices=("ours", "bare"), help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model.resolve()
    texts = make_texts(args.prompts)
    if args.side:
        out = side_ours(args, texts, args.workdir / "ours") if args.side == "ours" else side_bare(args, texts, args.workdir / "bare")
        args.result.write_text(json.dumps(out))
        return
    cmd = "python scripts/bench/sglang_engine.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        work = args.workdir.resolve() if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ours = run_side("ours", args, work)
        bare = run_side("bare", args, work)
    figs = figures(ours, bare, args.prompts)
    if not args.no_write:
        write_section(SECTION, section(cmd, args, figs, ours, bare))
    for k, v in figs.items():
        print(f"{k}: {v}")
    if args.check_answer:
        wrong = [side for side, out in (("ours", ours), ("bare", bare)) if "paris" not in (out["texts"][0] or "").lower()]
        if wrong:
            raise SystemExit(f"row 0 ({QUESTION!r}) was not answered with Paris by: {', '.join(wrong)}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
