"""Memory-bandwidth decode roofline for Qwen3-4B on one H200 (and one H100), and what a claim of it needs.

    python scripts/bench/roofline.py            # prints the figures, writes the roofline section of BENCHMARKS.md
    python scripts/bench/roofline.py --no-write
    python scripts/bench/roofline.py --status STATE/shard_0/status.json   # a measured run's fraction

With ``--status`` (a shard's status.json from a GPU run): the measured decode tokens/s per
GPU (status ``tokens_per_sec_per_gpu``: output tokens over the generation window) over the
memory-bound ceiling of that run's model on the GPU found (NVML name in ``hardware``, HBM
bandwidth from ``mirageflow.stats.formulas.GPU_HBM_BANDWIDTH``), at the run's B (``roofline_batch``:
sequences in flight per GPU, capped at max_running_requests) and mean context (input
tokens per request + half the output tokens per request), with the weight and KV bytes of
the model directory (``mirageflow.stats.formulas.model_memory_facts``). Fails naming what is missing
(no GPU name, a GPU without a bandwidth entry, a model without config.json). Printed last
``roofline_fraction`` and, beside it, the runner's own figure from status.json.

Formula (docs/shared reference "mmirage-format.md", the same as
``mirageflow.stats.formulas.decode_roofline_tokens_per_sec`` behind the report's roofline_fraction):

    tokens/s = B / ((weight_bytes + B * mean_context * kv_bytes_per_token) / HBM_bandwidth)

Each decode step reads the weights once and every in-flight sequence's KV cache, and
yields one token per sequence. Qwen3-4B: 8.04 GB of bf16 weights, 147,456 KV bytes per
token (36 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 bytes). Pure arithmetic: no
GPU, no model. Printed last, one per line, ``name: value``.
"""

from __future__ import annotations

from _common import write_section

import argparse
import datetime as dt
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "roofline"

# Reference facts (mmirage-format.md). HBM capacities and dense bf16 peak are the vendors' figures.
WEIGHT_BYTES = 8.04e9  # Qwen3-4B, bf16
KV_BYTES_PER_TOKEN = 147_456  # 2 (K, V) x 36 layers x 8 KV heads x 128 head dim x 2 bytes
GPUS = {  # name: (HBM bandwidth bytes/s, HBM capacity bytes)
    "H200": (4.8e12, 141e9),
    "H100": (3.35e12, 80e9),  # SXM5
}
BF16_DENSE_FLOPS = 989e12  # H100 SXM / H200, dense bf16 tensor cores
PARAMS = WEIGHT_BYTES / 2  # bf16: 2 bytes per parameter
BATCHES = [1, 8, 64, 256, 512]
CONTEXTS = [512, 2048]

# Published numbers (mmirage-format.md): output tok/s per GPU on one H100, Qwen3-4B.
PUBLISHED = [
    ("MMIRAGE end to end (SGLang 0.5.10, batch 64, 256 new tokens)", 10_937, 64),
    ("MMIRAGE without model load (same run)", 14_623, 64),
    ("DataTrove low (vLLM 0.15, s1K-1.1, 1024 new tokens)", 7_919, None),
    ("DataTrove high (same)", 8_086, None),
]


def roofline(
    batch: float, mean_context: float, bandwidth: float, weight_bytes: float = WEIGHT_BYTES, kv: float = KV_BYTES_PER_TOKEN
) -> float:
    """Decode ceiling in output tokens/s per GPU (memory-bandwidth bound)."""
    return batch * bandwidth / (weight_bytes + batch * mean_context * kv)


def max_context(tok_s: float, batch: float, bandwidth: float) -> float:
    """The largest mean context at which tok_s is still under the ceiling at this batch."""
    return (batch * bandwidth / tok_s - WEIGHT_BYTES) / (batch * KV_BYTES_PER_TOKEN)


def step_bytes(batch: float, mean_context: float) -> float:
    return WEIGHT_BYTES + batch * mean_context * KV_BYTES_PER_TOKEN


def compute_ceiling() -> float:
    """Tokens/s if decode were compute bound: 2 FLOP per parameter per token at dense bf16 peak."""
    return BF16_DENSE_FLOPS / (2 * PARAMS)


def consistency() -> str:
    """Check the report's implementation (mirageflow.stats.formulas) against this script's formula."""
    try:
        sys.path.insert(0, str(REPO / "src"))
        from mirageflow.stats.formulas import decode_roofline_tokens_per_sec
    except ImportError as e:
        return f"not checked ({e})"
    worst = 0.0
    for name, (bw, _) in GPUS.items():
        for b in BATCHES:
            for c in CONTEXTS:
                ours = roofline(b, c, bw)
                theirs = decode_roofline_tokens_per_sec(WEIGHT_BYTES, KV_BYTES_PER_TOKEN, b, c, bw)
                worst = max(worst, abs(ours - theirs) / ours)
    return "identical" if worst < 1e-12 else f"DIFFERS (max relative difference {worst:.2e})"


def figures() -> dict:
    out = {}
    h200, h100 = GPUS["H200"][0], GPUS["H100"][0]
    for c in CONTEXTS:
        for b in BATCHES:
            out[f"h200_b{b}_ctx{c}_tok_s"] = round(roofline(b, c, h200))
    out["h200_b256_ctx512_tok_s"] = round(roofline(256, 512, h200))
    out["h200_sync_batch64_ctx512_cap_tok_s"] = round(roofline(64, 512, h200))
    for label, tok_s, batch in PUBLISHED:
        key = label.split(" (")[0].lower().replace(" ", "_").replace("-", "_")
        b = batch or 256
        for c in (512, 1024, 2048):
            out[f"{key}_fraction_h100_b{b}_ctx{c}"] = round(tok_s / roofline(b, c, h100), 3)
        out[f"{key}_max_mean_ctx_h100_b{b}"] = round(max_context(tok_s, b, h100))
    out["compute_ceiling_tok_s"] = round(compute_ceiling())
    out["stats_formula_consistency"] = consistency()
    return out


def fits(batch: int, ctx: int, capacity: float) -> str:
    need = step_bytes(batch, ctx)
    return "yes" if need <= capacity else f"no ({need / 1e9:.0f} GB)"


def section(cmd: str) -> str:
    h200_bw, h200_cap = GPUS["H200"]
    h100_bw, h100_cap = GPUS["H100"]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "## Decode roofline: Qwen3-4B on one H200 (and one H100)",
        "",
        f"Command: `{cmd}` (arithmetic only; Python {platform.python_version()}, commit {commit}, "
        f"{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}).",
        "",
        "Formula (reference: mmirage-format.md; the same function as `mirageflow.stats.formulas.decode_roofline_tokens_per_sec`, "
        f"which the report's `roofline_fraction` uses: {consistency()} on every point below):",
        "",
        "    tokens/s per GPU = B / ((weight_bytes + B x mean_context x kv_bytes_per_token) / HBM_bandwidth)",
        "",
        f"Qwen3-4B: weight_bytes {WEIGHT_BYTES / 1e9:.2f} GB (bf16), kv_bytes_per_token {KV_BYTES_PER_TOKEN:,} "
        "(2 x 36 layers x 8 KV heads x 128 x 2 bytes). H200: 4.8 TB/s, 141 GB; H100 SXM: 3.35 TB/s, 80 GB. "
        "B = sequences decoding at once on the GPU; mean_context = tokens in each sequence's KV cache, averaged "
        "over the decode steps.",
        "",
        "### The curve (output tokens/s per GPU)",
        "",
        "| B | H200 ctx 512 | H200 ctx 2048 | H100 ctx 512 | H100 ctx 2048 | KV+weights fit in H200 (ctx 512 / 2048) | fit in H100 (ctx 512 / 2048) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in BATCHES:
        lines.append(
            f"| {b} | {roofline(b, 512, h200_bw):,.0f} | {roofline(b, 2048, h200_bw):,.0f} | {roofline(b, 512, h100_bw):,.0f} | "
            f"{roofline(b, 2048, h100_bw):,.0f} | {fits(b, 512, h200_cap)} / {fits(b, 2048, h200_cap)} | "
            f"{fits(b, 512, h100_cap)} / {fits(b, 2048, h100_cap)} |"
        )
    lines += [
        "",
        f"- H200, 256 sequences in flight at mean context 512: **{roofline(256, 512, h200_bw):,.0f} tok/s** (the reference's ~45k). "
        f"A synchronous batch of 64 caps it at **{roofline(64, 512, h200_bw):,.0f}** (~24k), and less in practice: as "
        "rows finish, the batch drains and B falls below 64 until the next batch starts.",
        f"- Weights alone cap B=1 at {roofline(1, 512, h200_bw):,.0f} tok/s on an H200; the curve flattens once the KV reads "
        f"dominate (B x ctx x kv > weights, i.e. B x ctx > {WEIGHT_BYTES / KV_BYTES_PER_TOKEN:,.0f} tokens): at ctx 2048 doubling "
        f"B from 256 to 512 buys {roofline(512, 2048, h200_bw) / roofline(256, 2048, h200_bw) - 1:.0%}, and B=512 x 2048 does not fit.",
        f"- Memory bound throughout: at 2 FLOP/parameter/token and {BF16_DENSE_FLOPS / 1e12:.0f} dense bf16 TFLOPS the compute "
        f"ceiling is {compute_ceiling():,.0f} tok/s, above every point of the table (attention FLOPs ignored). "
        "The formula ignores activation traffic and prefill, so it is an upper bound on decode throughput.",
        "",
        "### Published numbers as a fraction of the H100 roofline",
        "",
        "Their in-flight batch and mean context are only partly published. B: MMIRAGE's batch of 64; DataTrove "
        "(vLLM) up to 256 running sequences (vLLM's default max_num_seqs). Mean context = prompt + half the new "
        "tokens: MMIRAGE (256 new) ~512 with a ~384-token prompt, DataTrove (1,024 new) ~1,024 with a ~512-token "
        "prompt; both assumptions, so three contexts are shown. The last column solves the formula for the "
        "largest mean context at which the figure is still under the ceiling (a fraction above 1 means the run's "
        "context was shorter than that column's).",
        "",
        "| run | output tok/s/GPU | B | fraction, ctx 512 | ctx 1024 | ctx 2048 | at B=256, ctx 512 | max mean ctx at its B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, tok_s, batch in PUBLISHED:
        b = batch or 256
        cells = " | ".join(f"{tok_s / roofline(b, c, h100_bw):.2f}" for c in (512, 1024, 2048))
        lines.append(
            f"| {label} | {tok_s:,} | {b} | {cells} | {tok_s / roofline(256, 512, h100_bw):.2f} | {max_context(tok_s, b, h100_bw):,.0f} |"
        )
    mm, dtl, dth = PUBLISHED[1][1], PUBLISHED[2][1], PUBLISHED[3][1]
    lines += [
        "",
        f"- MMIRAGE without model load ({mm:,}) is {mm / roofline(64, 512, h100_bw):.2f} of the B=64 ceiling at ctx 512: "
        f"close to what a synchronous batch of 64 allows, but {mm / roofline(256, 512, h100_bw):.2f} of the B=256 "
        "ceiling at the same context: the gap to the H100 roofline is the batch (and its drain at every batch tail), "
        f"not the engine. End to end (model load included) it keeps {PUBLISHED[0][1] / roofline(64, 512, h100_bw):.2f} of the B=64 ceiling.",
        f"- DataTrove ({dtl:,}-{dth:,}) at B=256 is {dtl / roofline(256, 1024, h100_bw):.2f}-{dth / roofline(256, 1024, h100_bw):.2f} "
        f"of the ceiling at ctx 1024 and {dtl / roofline(256, 2048, h100_bw):.2f}-{dth / roofline(256, 2048, h100_bw):.2f} at ctx 2048 "
        f"(where 256 sequences do not fit in 80 GB: {fits(256, 2048, h100_cap)}). With 1,024 new tokens the KV reads, not "
        "the weights, set the ceiling, so its fraction hangs on the context: without the run's token counts per "
        "request it cannot be pinned down better than this range.",
        "",
        "### What our report must show to claim a fraction of it",
        "",
        "The report's `roofline_fraction` = tokens_per_sec_per_gpu / roofline(B, mean_context, HBM_BW of the GPU), "
        "per shard and in aggregate (capacity-weighted). A claim of fraction f needs, from the same run:",
        "",
        "1. **Tokens/s per GPU over generation time**: output (completion) tokens / (inference_runtime_seconds x "
        "num_gpus), GPUs counted as held (CUDA_VISIBLE_DEVICES), model load excluded (the `*_allocated` figures "
        "include it).",
        "2. **Mean context**: input_tokens / requests + (output_tokens / requests) / 2, from the status counters "
        "(the KV cache grows from the prompt to prompt + output while a sequence decodes).",
        "3. **Sustained B**: sequences actually decoding per GPU replica, time-averaged over the generation window: "
        "the engine's running-request count (SGLang `/metrics` `sglang:num_running_reqs`, or the engine's queue "
        "metrics), not the runner's `peak_inflight`. The runner keeps up to 2 x max_running_requests in flight, so "
        "peak_inflight / dp_size, capped at max_running_requests, is an upper bound on B: it gives the ceiling of the "
        "batch the engine was allowed, a fraction that is conservative for the engine but says nothing about whether "
        "B stayed high. Report both the fraction at the sustained B (engine efficiency) and at the largest B that fits "
        "in HBM (how much of the GPU the pipeline used).",
        "4. The GPU's name (NVML), mapped to its HBM bandwidth; the model's weight bytes and KV bytes per token "
        "(config.json: 2 x layers x KV heads x head_dim x dtype bytes).",
        "",
        "Tokens/s per H200 needed for a given fraction:",
        "",
        "| fraction | B=64, ctx 512 | B=256, ctx 512 | B=256, ctx 2048 |",
        "|---|---|---|---|",
    ]
    for f in (0.5, 0.7, 0.8, 0.9):
        lines.append(
            f"| {f:.1f} | {f * roofline(64, 512, h200_bw):,.0f} | {f * roofline(256, 512, h200_bw):,.0f} | {f * roofline(256, 2048, h200_bw):,.0f} |"
        )
    lines += ["", "Figures (the script's last lines):", "", "```"] + [f"{k}: {v}" for k, v in figures().items()] + ["```"]
    return "\n".join(lines)


def measured(status_path: Path) -> dict:
    """The roofline fraction of a measured run (``--status``); SystemExit naming what is missing."""
    import json

    sys.path.insert(0, str(REPO / "src"))
    from mirageflow.stats.formulas import hbm_bandwidth, model_memory_facts

    status = json.loads(status_path.read_text())
    st, hardware = status.get("stats") or {}, status.get("hardware") or {}
    gpu = hardware.get("gpu_name")
    if not gpu:
        raise SystemExit(f"{status_path}: no GPU name under hardware (NVML: {hardware.get('nvml_unavailable_reason') or 'no GPU'}); "
                         "run with stats: true on a GPU")  # fmt: skip
    bandwidth = hbm_bandwidth(gpu)
    if bandwidth is None:
        raise SystemExit(f"{status_path}: no HBM bandwidth known for GPU {gpu!r} (mirageflow.stats.formulas.GPU_HBM_BANDWIDTH)")
    engines = list((status.get("engines") or {}).values())
    if len(engines) != 1:
        raise SystemExit(f"{status_path}: expected one engine, found {len(engines)}")
    model = model_memory_facts(engines[0]["model_path"])
    if not model or not model.get("weight_bytes") or not model.get("kv_bytes_per_token"):
        raise SystemExit(f"{status_path}: weight/KV bytes unknown for model {engines[0]['model_path']!r}: {model}")
    tok_s, requests = st.get("tokens_per_sec_per_gpu"), st.get("requests")
    batch = st.get("roofline_batch") or st.get("peak_inflight")
    if not tok_s or not requests or not batch:
        raise SystemExit(f"{status_path}: no tokens_per_sec_per_gpu / requests / batch in stats")
    ctx = st["input_tokens"] / requests + st["output_tokens"] / requests / 2
    ceiling = roofline(batch, ctx, bandwidth, model["weight_bytes"], model["kv_bytes_per_token"])
    return {
        "gpu": gpu,
        "hbm_bandwidth_tb_s": bandwidth / 1e12,
        "model_weight_bytes": model["weight_bytes"],
        "model_kv_bytes_per_token": model["kv_bytes_per_token"],
        "batch": round(batch, 1),
        "mean_context": round(ctx, 1),
        "measured_tokens_per_s_per_gpu": round(tok_s, 1),
        "roofline_tokens_per_s_per_gpu": round(ceiling, 1),
        "status_roofline_fraction": None if st.get("roofline_fraction") is None else round(st["roofline_fraction"], 4),
        "roofline_fraction": round(tok_s / ceiling, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--status", type=Path, help="a GPU run's status.json: print its roofline fraction (writes nothing)")
    args = ap.parse_args()
    if args.status:
        for k, v in measured(args.status).items():
            print(f"{k}: {v}")
        return
    cmd = "python scripts/bench/roofline.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    if not args.no_write:
        write_section(SECTION, section(cmd))
    for k, v in figures().items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
