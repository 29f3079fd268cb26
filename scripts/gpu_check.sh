#!/usr/bin/env bash
# The project's one prepared GPU check: the workflow with the tiny model on the
# transformers engine on CUDA, with stats: true (NVML sampling), then status.json printed.
# Expected on a GPU node: engines.llm.device is the GPU's name, num_gpus 1, non-null
# gpu_util_* samples, the GPU name/driver under hardware, and energy figures.
# Needs the Python environment of requirements.txt with a CUDA build of torch. In the GPU
# environment (requirements-gpu.txt: sglang installed, driver >= 580) it then runs the same
# pipeline on the `sglang` and `sglang_server` backends too and prints their status.json
# engines and stats: one BOS per prompt (engines.llm.details.prompt_input), the backend
# choice, the SGLang version, tokens/s; each must end with a status.json (a crash fails it
# with failure.json naming the cause).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/mirageflow-gpu-check.XXXXXX)}"
mkdir -p "$work"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY'
import torch
import os
if not torch.cuda.is_available():
    # GPU_CHECK_ALLOW_CPU=1 runs the same check on a CPU-only machine (to test this script).
    assert os.environ.get("GPU_CHECK_ALLOW_CPU") == "1", "no CUDA device visible to torch"
    print("torch", torch.__version__, "device cpu (GPU_CHECK_ALLOW_CPU=1)")
else:
    print("torch", torch.__version__, "device", torch.cuda.get_device_name(0))
PY
python "$repo/scripts/make_tiny_model.py" "$work/tiny-llama" >/dev/null
python - "$work" <<'PY'
import json, sys
work = sys.argv[1]
with open(f"{work}/in.jsonl", "w") as f:
    for i in range(256):
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
python -m snakemake --snakefile "$repo/Snakefile" --directory "$work" --configfile "$work/pipeline.json" --cores 1 --quiet
cat "$work/state/shard_0/status.json"
python -c "import json,sys; a=json.load(open(sys.argv[1]))['aggregate']; print(json.dumps({k: a.get(k) for k in ('num_gpus','mean_gpu_util_pct','tokens_per_sec_per_gpu','gpu_days_per_billion_tokens','roofline_fraction')}, indent=2))" "$work/state/metrics.json"

# The SGLang backends, when this environment has sglang and torch sees a GPU.
if python -c 'import importlib.util, sys, torch; sys.exit(0 if importlib.util.find_spec("sglang") and torch.cuda.is_available() else 1)'; then
    for backend in sglang sglang_server; do
        python - "$work" "$backend" <<'PY'
import json, sys
work, backend = sys.argv[1], sys.argv[2]
cfg = json.load(open(f"{work}/pipeline.json"))
cfg["processors"][0]["backend"] = backend
# a 1.5 MB model: a small KV pool, no CUDA graphs (faster start); flags are ServerArgs fields
cfg["processors"][0]["server_args"].update(tp_size=1, dp_size=1, extra_engine_args={
    "mem_fraction_static": 0.3, "disable_cuda_graph": True, "context_length": 512, "max_running_requests": 64})
cfg["loading_params"]["state_dir"] = f"{work}/state-{backend}"
for ds in cfg["loading_params"]["datasets"]:
    ds["output_dir"] = f"{work}/out-{backend}"
json.dump(cfg, open(f"{work}/pipeline-{backend}.json", "w"))
PY
        echo "== backend $backend"
        if ! python -m snakemake --snakefile "$repo/Snakefile" --directory "$work" --configfile "$work/pipeline-$backend.json" --cores 1 --quiet; then
            cat "$work/state-$backend/shard_0/failure.json" 2>/dev/null || echo "no failure.json for $backend" >&2
            exit 1
        fi
        python -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({'engines': s.get('engines'), 'tokens_per_sec': (s.get('stats') or {}).get('tokens_per_sec')}, indent=2, default=str))" "$work/state-$backend/shard_0/status.json"
    done
else
    echo "NOTE: sglang not installed or no GPU usable by torch: sglang/sglang_server not checked (pip install -r requirements-gpu.txt)"
fi
