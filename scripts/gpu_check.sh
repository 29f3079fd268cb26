#!/usr/bin/env bash
# The project's one prepared GPU check: the workflow with the tiny model on the
# transformers engine on CUDA, with stats: true (NVML sampling), then status.json printed.
# Expected on a GPU node: engines.llm.device is the GPU's name, num_gpus 1, non-null
# gpu_util_* samples, the GPU name/driver under hardware, and energy figures.
# Needs the Python environment of requirements.txt with a CUDA build of torch.
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
