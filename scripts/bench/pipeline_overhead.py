"""Per-row pipeline overhead: rows/s through everything around the engine, ours vs MMIRAGE 0.1.4.

    python scripts/bench/pipeline_overhead.py            # full run, ~10 min (+1-2 min once: MMIRAGE's venv)
    python scripts/bench/pipeline_overhead.py --rows 20000 --repeats 3 --no-mmirage
    python scripts/bench/pipeline_overhead.py --profile plain   # cProfile of our shard, top functions
    python scripts/bench/pipeline_overhead.py --cache-cost --rows 20000 --repeats 4   # the request cache's cost per row
    python scripts/bench/pipeline_overhead.py --cache-cost --compare-src ../main/src --repeats 8   # ... and other code, run for run

An instant engine answers every request at once with a fixed completion (and token
counts), so what is measured is the work that must never make a GPU wait: reading the
JSONL, JMESPath extraction, rendering the prompt, the model's chat template (the tiny
test model's real tokenizer), rendering the output record, JSON parsing + schema
validation (JSON variant), writing the records (Parquet part files, checkpoints).

- ours: ``run_shard`` on one shard of a generated JSONL with an ``InstantEngine`` factory;
  rows / (shard runtime - engine load).
- MMIRAGE 0.1.4 (PyPI, in its own Python >= 3.12 venv under ~/.cache/mirageflow-bench):
  its shard path (load_dataset, Dataset.map(rewrite_batch, batched, batch_size 64) with its
  mapper/LLMProcessor/renderer, save_to_disk) with a stub ``sglang`` whose
  ``Engine.generate`` returns the same completion; rows / (load + map + save).
  ``map only`` leaves out its JSON->Arrow load and save_to_disk.

Both run pinned to one CPU, interleaved, ``--repeats`` times; medians are reported.

Two more variants of ours measure the steps that are not LLM calls (mirageflow.shard.steps.python),
each added to ``plain``: ``plain_filter`` (a filter step whose predicate, on the LLM output,
keeps every row, so the same records are written) and ``plain_custom`` (a custom step: a
Python function per row in one worker process, which shares the pinned CPU). Their cost
per row is reported as microseconds over ``plain``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import glob
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C
from _engines import InstantEngine

PLAIN_COMPLETION = "The passage describes how the river model results change energy policy in one short sentence."
JSON_COMPLETION = json.dumps({"question": "What does the passage describe?", "answer": "How the river model results change energy policy."})
COMPLETION_TOKENS = 20
MMIRAGE_VERSION = "0.1.4"
TARGET_ROWS_PER_SEC = 20_000  # plain output, one core
TARGET_SPEEDUP = 10.0


# The custom step's function (plain_custom): a little real work on the variables.
STEP_SCRIPT = "def words(v):\n    return len(v['summary'].split()) + len(v['title'])\n"


def pipeline_config(data: Path, out: Path, state: Path, kind: str, tokenizer: str) -> dict:
    """One MMIRAGE-format config, valid for both systems (plain_filter, plain_custom: ours only)."""
    inputs = [{"name": "id", "key": "id"}, {"name": "title", "key": "title"}, {"name": "text", "key": "text"}]
    processors = [
        {"type": "llm", "server_args": {"model_path": tokenizer}, "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 64}}
    ]
    if kind.startswith("plain"):
        outputs = [{"name": "summary", "type": "llm", "output_type": "plain", "prompt": "Summarise in one sentence: {{ text }}"}]
        shape = {"id": "{{ id }}", "title": "{{ title }}", "summary": "{{ summary }}"}
        if kind == "plain_filter":  # true for every row: the same records as plain
            outputs.append({"name": "long_enough", "type": "filter", "predicate": "summary | length > 10"})
        elif kind == "plain_custom":
            script = out.parent / "bench_step.py"
            script.write_text(STEP_SCRIPT)
            processors.append({"type": "custom", "script_path": str(script), "function_name": "words"})
            outputs.append({"name": "n_words", "type": "custom"})
            shape["n_words"] = "{{ n_words }}"
    else:
        outputs = [{
            "name": "qa", "type": "llm", "output_type": "JSON", "output_schema": ["question", "answer"],
            "prompt": "Write one question and its answer about this passage.\nTitle: {{ title }}\n{{ text }}",
        }]  # fmt: skip
        shape = {
            "id": "{{ id }}",
            "conversations": [{"role": "user", "content": "{{ qa.question }}"}, {"role": "assistant", "content": "{{ qa.answer }}"}],
        }
    return {
        "processors": processors,
        "loading_params": {
            "state_dir": str(state),
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(out)}],
            "num_shards": 1,
            "shard_id": 0,
            "batch_size": 64,
        },
        "processing_params": {"inputs": inputs, "outputs": outputs, "remove_columns": True, "output_schema": shape},
    }


# --------------------------------------------------------------------------- ours


def run_ours(cfg_dict: dict, tokenizer: str, kind: str, chat: str = "fast") -> dict:
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets, run_shard

    for key in ("state_dir",):
        shutil.rmtree(cfg_dict["loading_params"][key], ignore_errors=True)
    for ds in cfg_dict["loading_params"]["datasets"]:
        shutil.rmtree(ds["output_dir"], ignore_errors=True)
    cfg = load_config(cfg_dict)
    index_datasets(cfg)
    completion = PLAIN_COMPLETION if kind.startswith("plain") else JSON_COMPLETION

    engines = []
    load_cpu = []  # process CPU time when the shard starts loading its engines

    def factory(processor, batch_size, *args, **kwargs):
        load_cpu.append(time.process_time())
        engines.append(InstantEngine(tokenizer, completion, COMPLETION_TOKENS, chat=chat))
        return engines[-1]

    cpu0, children0 = time.process_time(), os.times()
    status = run_shard(cfg, 0, engine_factory=factory)
    cpu1 = time.process_time()
    cpu = cpu1 - cpu0 - sum(e.load_cpu_seconds for e in engines)
    # per shard, not per row: from the engine load to the first request (the load, the one full
    # garbage collection after it, the request cache's engine identity)
    firsts = [e.first_request_cpu for e in engines if e.first_request_cpu is not None]
    fixed = (min(firsts) - load_cpu[0]) if firsts and load_cpu else 0.0
    children1 = os.times()  # a custom step's workers, stopped and reaped by run_shard (their start included)
    child_cpu = children1.children_user + children1.children_system - children0.children_user - children0.children_system
    st = status["stats"]
    seconds = st["runtime_seconds"] - st["model_load_seconds"]
    rows = st["rows_processed"]
    assert st["rows_failed"] == 0 and not st.get("rows_filtered"), st
    return {
        "rows": rows, "seconds": seconds, "rows_per_sec": rows / seconds, "cpu_seconds": cpu, "cpu_rows_per_sec": rows / cpu,
        "child_cpu_seconds": child_cpu, "row_cpu_seconds": cpu1 - cpu0 - fixed, "row_cpu_rows_per_sec": rows / (cpu1 - cpu0 - fixed),
    }  # fmt: skip


# --------------------------------------------------------------------------- MMIRAGE


def _base_python_312() -> str:
    candidates = [os.environ.get("MMIRAGE_BASE_PYTHON"), shutil.which("python3.13"), shutil.which("python3.12")]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/3.1[2-9]*/bin/python"))
    for c in candidates:
        if not c or not os.path.exists(c):
            continue
        out = subprocess.run([c, "-c", "import sys; print(sys.version_info >= (3, 12))"], capture_output=True, text=True)
        if out.stdout.strip() == "True":
            return c
    raise SystemExit("MMIRAGE needs Python >= 3.12: set MMIRAGE_BASE_PYTHON (or use --no-mmirage)")


def mmirage_python() -> str:
    """MMIRAGE 0.1.4 in its own venv (built once), without sglang and its GPU stack.

    The packages both systems use are pinned to the versions installed here, so both
    sides run the same transformers/tokenizers/jinja2/jmespath/datasets/pyarrow.
    """
    shared = ["transformers", "tokenizers", "jinja2", "jmespath", "datasets", "pyarrow"]
    pins = [f"{p}=={v}" for p, v in C.versions(*shared).items() if v != "not installed"]
    cache = Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "mirageflow-bench"
    venv = cache / f"mmirage-{MMIRAGE_VERSION}-venv"
    marker = venv / ".mirageflow-bench-ready"
    python = venv / "bin" / "python"
    if marker.exists() and marker.read_text().strip() == " ".join(pins):
        return str(python)
    shutil.rmtree(venv, ignore_errors=True)
    base = _base_python_312()
    print(f"building MMIRAGE {MMIRAGE_VERSION} venv in {venv} with {base} (once)...", file=sys.stderr, flush=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # sglang, sgl-kernel, xgrammar, torch: GPU stack MMIRAGE imports only in LLMProcessor (stubbed)
    subprocess.run(pip + ["--no-deps", f"mmirage=={MMIRAGE_VERSION}"], check=True)
    subprocess.run(pip + pins + ["dacite", "pyyaml", "pydantic", "pillow", "tqdm"], check=True)
    marker.write_text(" ".join(pins) + "\n")
    return str(python)


def run_mmirage(python: str, cfg_dict: dict, kind: str, work: Path) -> dict:
    import yaml

    for ds in cfg_dict["loading_params"]["datasets"]:
        shutil.rmtree(ds["output_dir"], ignore_errors=True)
    cfg_path = work / f"mmirage_{kind}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    hf = Path(tempfile.mkdtemp(dir=work, prefix="hf-"))  # a fresh datasets cache: JSONL -> Arrow as in a new job
    env = {**os.environ, "HF_HOME": str(hf), "HF_DATASETS_CACHE": str(hf / "datasets"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    env.pop("BENCH_MIRAGEFLOW_SRC", None)
    completion = PLAIN_COMPLETION if kind == "plain" else JSON_COMPLETION
    driver = Path(__file__).resolve().parent / "_mmirage_driver.py"
    out = subprocess.run(
        [python, str(driver), str(cfg_path), json.dumps(completion), str(COMPLETION_TOKENS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
    )
    shutil.rmtree(hf, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"MMIRAGE driver failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    total = res["load_s"] + res["map_s"] + res["save_s"]
    res.update(
        seconds=total,
        rows_per_sec=res["rows"] / total,
        map_rows_per_sec=res["rows"] / res["map_s"],
        cpu_rows_per_sec=res["rows"] / res["cpu_s"],
    )
    return res


# --------------------------------------------------------------------------- main


def tiny_model() -> str:
    path = Path(os.environ.get("BENCH_TINY_MODEL", "/tmp/bench-tiny"))
    if not (path / "tokenizer.json").exists():
        from mirageflow.model_prep import build_tiny_llama

        build_tiny_llama(path)
    return str(path)


def profile(kind: str, rows: int, tokenizer: str, work: Path) -> None:
    data = C.write_jsonl(work / "data.jsonl", C.make_rows(rows))
    cfg = pipeline_config(data, work / f"out_{kind}", work / f"state_{kind}", kind, tokenizer)
    prof = cProfile.Profile()
    prof.enable()
    res = run_ours(cfg, tokenizer, kind)
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    stats.print_stats(30)
    print(f"rows/s (under cProfile): {res['rows_per_sec']:.0f}")


CACHE_TARGET_US = 5.0  # what the request cache may add per row (CPU of the shard process)


def _cache_configs(rows: int, tokenizer: str, work: Path) -> dict[str, dict]:
    data = C.write_jsonl(work / "data.jsonl", C.make_rows(rows))
    on = pipeline_config(data, work / "out", work / "state", "plain", tokenizer)
    return {"cache_on": on, "cache_off": {**on, "shard_params": {"request_cache": False}}}


def cache_runs(rows: int, repeats: int, tokenizer: str, work: Path) -> dict[str, list[dict]]:
    """ours_plain with the request cache on and off (``shard_params.request_cache``), after a
    warm-up, in turns (on, off, then off, on: a drift of the machine's load weighs on both)."""
    configs = _cache_configs(rows, tokenizer, work)
    run_ours(copy.deepcopy(configs["cache_on"]), tokenizer, "plain")
    results: dict[str, list[dict]] = {"cache_on": [], "cache_off": []}
    for rep in range(repeats):
        for name in ("cache_on", "cache_off") if rep % 2 == 0 else ("cache_off", "cache_on"):
            results[name].append(run_ours(copy.deepcopy(configs[name]), tokenizer, "plain"))
    return results


def cache_serve(rows: int, tokenizer: str, work: Path) -> None:
    """--compare-src's worker: after a warm-up, one run per line read (``cache_on`` or
    ``cache_off``), its result a JSON line."""
    configs = _cache_configs(rows, tokenizer, work)
    run_ours(copy.deepcopy(configs["cache_on"]), tokenizer, "plain")
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(run_ours(copy.deepcopy(configs[line.strip()]), tokenizer, "plain")), flush=True)


def cache_figures(results: dict[str, list[dict]]) -> dict[str, float]:
    """Medians: rows/s, CPU per row of the whole shard (minus the tokenizer's load), and CPU per
    row without the per-shard fixed costs (``row_cpu_seconds``), per variant; and the cache's cost."""
    out = {}
    for name, rs in results.items():
        out[f"{name}_rows_per_sec"] = C.median([r["rows_per_sec"] for r in rs])
        out[f"{name}_cpu_us_per_row"] = C.median([1e6 * r["cpu_seconds"] / r["rows"] for r in rs])
        out[f"{name}_row_cpu_us_per_row"] = C.median([1e6 * r["row_cpu_seconds"] / r["rows"] for r in rs])
        # the least disturbed run: other tenants only ever add CPU time (caches, a busy sibling hyperthread)
        out[f"{name}_row_cpu_us_per_row_min"] = min(1e6 * r["row_cpu_seconds"] / r["rows"] for r in rs)
    out["cache_on_rows_per_cpu_sec"] = 1e6 / out["cache_on_row_cpu_us_per_row"]
    # the median of the differences of the runs made one after the other (a pair), steadier on a
    # shared machine than the difference of the medians, which is also given
    out["request_cache_cpu_us_per_row"] = C.median([
        1e6 * (on["row_cpu_seconds"] / on["rows"] - off["row_cpu_seconds"] / off["rows"])
        for on, off in zip(results["cache_on"], results["cache_off"])
    ])  # fmt: skip
    out["request_cache_cpu_us_per_row_of_medians"] = out["cache_on_row_cpu_us_per_row"] - out["cache_off_row_cpu_us_per_row"]
    return out


def cache_cost(rows: int, repeats: int, tokenizer: str, work: Path, compare_src: str | None) -> None:
    """What the request cache costs per row, and whether the plain pipeline with it meets the
    targets; with ``compare_src``, this code and that one (e.g. main's src) side by side: a
    worker process per code, each run of one followed by the same run of the other (their
    order alternating), so both see the same load."""
    if compare_src is None:
        _print_cache_figures("this code", cache_figures(cache_runs(rows, repeats, tokenizer, work)))
        return
    workers, logs = {}, {}
    for side, src in (("this code", None), ("compare", compare_src)):
        env = {k: v for k, v in os.environ.items() if k != "BENCH_MIRAGEFLOW_SRC"}
        if src:
            env["BENCH_MIRAGEFLOW_SRC"] = src
        cmd = [sys.executable, __file__, "--cache-cost", "--rows", str(rows), "--no-pin", "--serve"]
        logs[side] = work / ("this.stderr" if src is None else "compare.stderr")
        with open(logs[side], "w") as err:  # the worker keeps its own descriptor
            workers[side] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    for side, w in workers.items():
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{side} failed: {logs[side].read_text()[-4000:]}")
    per: dict[str, dict[str, list[dict]]] = {side: {"cache_on": [], "cache_off": []} for side in workers}
    sides = list(workers)
    try:
        for rep in range(repeats):
            for name in ("cache_on", "cache_off") if rep % 2 == 0 else ("cache_off", "cache_on"):
                for side in sides if (rep // 2) % 2 == 0 else sides[::-1]:
                    workers[side].stdin.write(name + "\n")
                    workers[side].stdin.flush()
                    line = workers[side].stdout.readline()
                    if not line:
                        raise RuntimeError(f"{side} failed: {logs[side].read_text()[-4000:]}")
                    per[side][name].append(json.loads(line))
            print(f"repeat {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait()
    for side, results in per.items():
        _print_cache_figures(f"{side} ({compare_src})" if side == "compare" else side, cache_figures(results))
    for name in ("cache_on", "cache_off"):  # the paired ratio: each run of this code over the same run of the other
        ratio = C.median([
            (a["rows"] / a["row_cpu_seconds"]) / (b["rows"] / b["row_cpu_seconds"])
            for a, b in zip(per["this code"][name], per["compare"][name])
        ])  # fmt: skip
        print(f"ours_plain {name}: this code / compare, rows per CPU-second (median of the pairs): {ratio:.2f}")


def _print_cache_figures(label: str, f: dict[str, float]) -> None:
    print(f"{label}:")
    for name in ("cache_on", "cache_off"):
        print(
            f"  ours_plain {name}: {C.fmt(f[f'{name}_rows_per_sec'])} rows/s, {f[f'{name}_cpu_us_per_row']:.1f} us CPU per row "
            f"(whole shard), {f[f'{name}_row_cpu_us_per_row']:.1f} us per row without the fixed costs "
            f"(fastest run: {f[f'{name}_row_cpu_us_per_row_min']:.1f} us)"
        )
    rate, cost = f["cache_on_rows_per_cpu_sec"], f["request_cache_cpu_us_per_row"]
    print(
        f"  plain, cache on: {C.fmt(rate)} rows per CPU-second (target {TARGET_ROWS_PER_SEC:,}: {'met' if rate >= TARGET_ROWS_PER_SEC else 'NOT met'})"
    )
    print(
        f"  request cache: {cost:.1f} us CPU per row, the median of the pairs' differences (target <= {CACHE_TARGET_US:.0f}: "
        f"{'met' if cost <= CACHE_TARGET_US else 'NOT met'}); the difference of the medians: "
        f"{f['request_cache_cpu_us_per_row_of_medians']:.1f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--mmirage-rows", type=int, default=5_000, help="MMIRAGE runs on this prefix of the same rows (it is far slower)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-mmirage", action="store_true", help="measure ours only")
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    ap.add_argument("--profile", choices=["plain", "json"], help="cProfile our shard on this variant and exit")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--cache-cost", action="store_true", help="ours_plain with the request cache on and off, interleaved, and exit")
    ap.add_argument("--compare-src", help="--cache-cost: also measure this copy of src/ (e.g. main's), side by side in turns")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # --compare-src's worker
    args = ap.parse_args()

    pinned = "not pinned" if args.no_pin else C.pin_to_one_core()
    tokenizer = tiny_model()
    info = C.machine("mirageflow", "transformers", "tokenizers", "jinja2", "jmespath", "jsonschema", "pyarrow", "datasets")
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        if args.profile:
            profile(args.profile, args.rows, tokenizer, work)
            return
        if args.cache_cost and args.serve:
            cache_serve(args.rows, tokenizer, work)
            return
        if args.cache_cost:
            cache_cost(args.rows, args.repeats, tokenizer, work, args.compare_src)
            return
        mm_python = None if args.no_mmirage else mmirage_python()
        all_rows = C.make_rows(args.rows)
        data = C.write_jsonl(work / "data.jsonl", all_rows)
        mm_data = C.write_jsonl(work / "data_mmirage.jsonl", all_rows[: args.mmirage_rows])
        variants = []  # (name, fn)
        for kind in ("plain", "json"):
            ours_cfg = pipeline_config(data, work / f"ours_out_{kind}", work / f"ours_state_{kind}", kind, tokenizer)
            variants.append((f"ours_{kind}", lambda c=ours_cfg, k=kind: run_ours(c, tokenizer, k)))
            if kind == "plain":  # our pipeline with transformers' apply_chat_template on every row
                variants.append((f"ours_{kind}_hf_chat", lambda c=ours_cfg, k=kind: run_ours(c, tokenizer, k, chat="transformers")))
                for step in ("plain_filter", "plain_custom"):  # plain + a filter step / a Python step
                    step_cfg = pipeline_config(data, work / f"ours_out_{step}", work / f"ours_state_{step}", step, tokenizer)
                    variants.append((f"ours_{step}", lambda c=step_cfg, k=step: run_ours(c, tokenizer, k)))
            if mm_python:
                mm_cfg = pipeline_config(mm_data, work / f"mm_out_{kind}", work / f"mm_state_{kind}", kind, tokenizer)
                variants.append((f"mmirage_{kind}", lambda c=mm_cfg, k=kind: run_mmirage(mm_python, c, k, work)))
        results: dict[str, list[dict]] = {name: [] for name, _ in variants}
        mm_versions = None
        variants[0][1]()  # warm-up: imports and first-use caches (pyarrow, jinja2) are not per-row costs
        for rep in range(args.repeats):
            for name, fn in variants:
                res = fn()
                results[name].append(res)
                mm_versions = res.get("versions", mm_versions)
                print(
                    f"repeat {rep + 1}/{args.repeats} {name}: {res['rows_per_sec']:,.0f} rows/s, {res['cpu_rows_per_sec']:,.0f} rows/CPU-s ({res['rows']} rows in {res['seconds']:.2f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {name: C.median([r["rows_per_sec"] for r in rs]) for name, rs in results.items()}
    cpu = {name: C.median([r["cpu_rows_per_sec"] for r in rs]) for name, rs in results.items()}
    figures = {}
    for kind in ("plain", "json"):
        figures[f"ours_{kind}_rows_per_sec"] = med[f"ours_{kind}"]
        figures[f"ours_{kind}_rows_per_cpu_sec"] = cpu[f"ours_{kind}"]
        if mm_python:
            figures[f"mmirage_{kind}_rows_per_sec"] = med[f"mmirage_{kind}"]
            figures[f"mmirage_{kind}_rows_per_cpu_sec"] = cpu[f"mmirage_{kind}"]
            figures[f"mmirage_{kind}_map_only_rows_per_sec"] = C.median([r["map_rows_per_sec"] for r in results[f"mmirage_{kind}"]])
            figures[f"{kind}_speedup_vs_mmirage"] = med[f"ours_{kind}"] / med[f"mmirage_{kind}"]
            figures[f"{kind}_speedup_vs_mmirage_cpu"] = cpu[f"ours_{kind}"] / cpu[f"mmirage_{kind}"]
            figures[f"{kind}_speedup_vs_mmirage_map_only"] = med[f"ours_{kind}"] / figures[f"mmirage_{kind}_map_only_rows_per_sec"]
    figures["ours_plain_hf_chat_rows_per_sec"] = med["ours_plain_hf_chat"]
    figures["ours_plain_hf_chat_rows_per_cpu_sec"] = cpu["ours_plain_hf_chat"]
    for step in ("filter", "custom"):  # what the step adds per row over plain
        figures[f"ours_plain_{step}_rows_per_sec"] = med[f"ours_plain_{step}"]
        figures[f"ours_plain_{step}_rows_per_cpu_sec"] = cpu[f"ours_plain_{step}"]
        figures[f"{step}_step_wall_us_per_row"] = 1e6 / med[f"ours_plain_{step}"] - 1e6 / med["ours_plain"]
        # CPU of the shard process: the steadier figure (for custom: what the event loop's process pays)
        figures[f"{step}_step_cpu_us_per_row"] = 1e6 / cpu[f"ours_plain_{step}"] - 1e6 / cpu["ours_plain"]
    worker = C.median([r["child_cpu_seconds"] / r["rows"] for r in results["ours_plain_custom"]])
    figures["custom_step_worker_cpu_us_per_row"] = 1e6 * worker  # the worker process's CPU, its start included

    verdicts = [
        f"- ours_plain >= {TARGET_ROWS_PER_SEC:,} rows/s on one core: **{'met' if med['ours_plain'] >= TARGET_ROWS_PER_SEC else 'NOT met'}** "
        f"({C.fmt(med['ours_plain'])} rows/s)"
    ]
    if mm_python:
        for kind in ("plain", "json"):
            x = figures[f"{kind}_speedup_vs_mmirage"]
            verdicts.append(f"- ours_{kind} >= {TARGET_SPEEDUP:.0f}x MMIRAGE: **{'met' if x >= TARGET_SPEEDUP else 'NOT met'}** ({x:.1f}x)")

    if not args.no_write:
        rows = []
        for name, rs in results.items():
            vals = [r["rows_per_sec"] for r in rs]
            rows.append([name, rs[0]["rows"], C.fmt(C.median(vals)), ", ".join(C.fmt(v) for v in vals), C.fmt(cpu[name])])
        cmd = "python scripts/bench/pipeline_overhead.py" + "".join(f" {a}" for a in sys.argv[1:])
        body = f"""## Per-row pipeline overhead (`scripts/bench/pipeline_overhead.py`)

Rows/s through everything around the engine, with an engine that answers at once (fixed
completion of {COMPLETION_TOKENS} tokens; it yields to the event loop once per request, as a
real engine whose answer arrives later does): JSONL read, JMESPath extraction, prompt rendering, the
tiny test model's chat template, record rendering, JSON parsing and validation (JSON
variant), Parquet part files and checkpoints (ours, default settings: every 500 rows
but at most once a second; each commit fsyncs a part file and the manifest) or `save_to_disk` (MMIRAGE). 1 shard, {pinned};
{args.repeats} interleaved repeats after one warm-up run, median. Ours runs {args.rows:,} rows, MMIRAGE the
first {min(args.mmirage_rows, args.rows):,} of them (it is far slower; these are rates). rows/s is wall time (ours:
shard runtime minus engine load; MMIRAGE: load + map + save); rows per CPU-second counts
only the CPU the process got, which is the steadier figure on a shared machine.

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}- MMIRAGE side: {json.dumps(mm_versions) if mm_versions else "not run"}, sglang replaced by a stub `Engine.generate`

Variants: `ours_plain` (one plain output, short template), `ours_json` (one JSON output with
a 2-field schema, nested record), `ours_plain_hf_chat` (as `ours_plain` but the engine calls
`tokenizer.apply_chat_template` per row instead of the compiled template of
`mirageflow.engines.chat_template.ChatTemplate`), `ours_plain_filter` (as `ours_plain` plus a filter
step `summary | length > 10`, true for every row), `ours_plain_custom` (as `ours_plain` plus a
custom step: a Python function per row in one worker process, on the same pinned CPU; its
rows per CPU-second leave out the worker's CPU), `mmirage_*` (MMIRAGE {MMIRAGE_VERSION} on the
same rows and config). What a step adds per row: `*_step_wall_us_per_row` from the median
rows/s (1e6 / step variant - 1e6 / ours_plain; noisy on a shared machine),
`*_step_cpu_us_per_row` from the rows per CPU-second of the shard process (for the custom
step: the process that feeds the engine; the function runs elsewhere), and
`custom_step_worker_cpu_us_per_row`: the worker process's CPU per row, its start (spawn,
imports, ~0.3 s) included.

{C.table(["variant", "rows", "median rows/s", "all repeats (rows/s)", "median rows per CPU-second"], rows)}

Targets:

{chr(10).join(verdicts)}

Figures:

```
{chr(10).join(f"{k}: {v:.1f}" if abs(v) >= 10 else f"{k}: {v:.3g}" for k, v in figures.items())}
```
"""
        C.write_section("pipeline_overhead", body)
    C.print_figures(figures)


if __name__ == "__main__":
    main()
