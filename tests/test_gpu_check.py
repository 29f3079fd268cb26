"""scripts/gpu_check.sh on the CPU (GPU_CHECK_ALLOW_CPU=1, a tiny shape), so it cannot rot; what it carries;
and the SLURM profile of the GPU install."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import gpu_carry  # scripts/gpu_carry.py (pytest puts scripts/ on the path: pyproject.toml)
import gpu_check  # scripts/gpu_check.py
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

NAMES = (
    "python", "torch", "transformers", "carried_wheels", "tokenizer", "model_shape", "model_parameters", "model_weight_bytes",
    "pipeline_tokens_per_sec", "pipeline_tokens_per_sec_per_gpu", "pipeline_requests_continuous_batching",
    "shard_job_imports_missing_on_gpu_machine", "bare_tokens_per_sec", "pipeline_vs_bare_ratio", "roofline_fraction",
    "sampler_gpu_util_mean_pct", "sampler_gpu_energy_joules", "nvidia_smi_gpu_util_mean_pct", "nvidia_smi_energy_joules",
    "model_load_seconds", "model_weights_load_seconds", "gpu_hours_loading_1000_shards_unshared",
    "gpu_hours_loading_1000_shards_shared_8",
)  # fmt: skip


def _figures(stdout: str) -> dict[str, str]:
    tail = stdout.split("\n== figures\n", 1)[1]
    return dict(line.split(": ", 1) for line in tail.splitlines() if ": " in line)


@pytest.fixture(scope="module")
def carried(tmp_path_factory) -> Path:
    """The carried wheels, for this interpreter (the GPU machine gets them for 3.12), from PyPI."""
    dest = tmp_path_factory.mktemp("carry")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_carry.py"), "--dest", str(dest), "--python-version", version,
                           "--no-tokenizer"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "total_bytes" in proc.stdout
    return dest


def test_the_check_runs_on_the_cpu_and_prints_every_figure(carried, tmp_path):
    env = {**os.environ, "GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_CARRY": str(carried), "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    summary = proc.stdout.split("== summary", 1)[1].split("== figures", 1)[0]
    assert summary.count("\nOK ") == 10 and "FAILED" not in summary
    fig = _figures(proc.stdout)
    assert set(NAMES) <= set(fig), set(NAMES) - set(fig)
    prompts, tokens = 16, 8
    assert fig["model_shape"] == "tiny (Qwen3 architecture)" and fig["tokenizer"] == "tiny (offline)"
    assert fig["carried_wheels"] == "jmespath, jsonschema, jsonschema_specifications, orjson, referencing, rpds_py"
    assert fig["shard_job_imports_missing_on_gpu_machine"] == "jmespath, jsonschema, orjson"
    assert int(fig["pipeline_requests_continuous_batching"]) == prompts  # every request through the manager
    assert int(fig["pipeline_output_tokens"]) == int(fig["bare_output_tokens"]) == prompts * tokens  # fixed lengths
    ours, bare, ratio = float(fig["pipeline_tokens_per_sec"]), float(fig["bare_tokens_per_sec"]), float(fig["pipeline_vs_bare_ratio"])
    assert ours > 0 and bare > 0 and math.isclose(ratio, ours / bare, rel_tol=1e-3)
    # no GPU here: per-GPU figures say why they are null, nothing is invented
    assert fig["pipeline_tokens_per_sec_per_gpu"] == "null (no GPU)"
    assert fig["roofline_fraction"].startswith("null (no GPU: ") and "no GPU name" in fig["roofline_fraction"]
    for name in ("sampler_gpu_util_mean_pct", "sampler_gpu_energy_joules", "nvidia_smi_gpu_util_mean_pct", "nvidia_smi_energy_joules"):
        assert fig[name].startswith("null ("), name
    load = float(fig["model_load_seconds"])
    assert load > float(fig["model_weights_load_seconds"]) > 0
    assert math.isclose(float(fig["gpu_hours_loading_1000_shards_unshared"]), 1000 * load / 3600, rel_tol=1e-3)
    assert math.isclose(float(fig["gpu_hours_loading_1000_shards_shared_8"]), 125 * load / 3600, rel_tol=1e-3)


def test_without_a_gpu_it_fails_loudly_at_the_first_step(tmp_path):
    env = {**os.environ, "GPU_CHECK_ALLOW_CPU": "0", "PYTHON": sys.executable}
    proc = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert "GPU CHECK FAILED: 1. environment: torch" in proc.stderr and "sees no CUDA device" in proc.stderr
    assert "== 2." not in proc.stdout  # nothing else runs without torch on a GPU


def test_carried_set_is_what_the_gpu_machine_lacks():
    # jsonschema's own requirements come along (rpds-py compiled: its cp312 manylinux wheel); attrs and
    # typing-extensions are there
    assert list(gpu_carry.missing_on_gpu_machine()) == [
        "jmespath",
        "jsonschema",
        "jsonschema-specifications",
        "orjson",
        "referencing",
        "rpds-py",
    ]
    assert gpu_carry.missing_on_gpu_machine(roots=("torch", "transformers", "pyarrow")) == {}


def test_what_travels_stays_under_the_limit(tmp_path):
    sizes = gpu_carry.check_size(tmp_path)  # the working tree alone (nothing carried in tmp_path)
    assert 0 < sizes["working_tree_bytes"] == sizes["total_bytes"] < gpu_carry.LIMIT_BYTES
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (gpu_carry.LIMIT_BYTES - sizes["working_tree_bytes"] + 1))
    with pytest.raises(SystemExit, match="over the GPU machine's 64 MiB"):
        gpu_carry.check_size(tmp_path)


def test_importtime_attributes_imports_to_our_code():
    text = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       10 |         10 |       httpcore2",
        "import time:       10 |         20 |     transformers.utils.hub",
        "import time:       10 |         30 |   transformers",
        "import time:       10 |         10 |   jsonschema",
        "import time:       10 |         50 | mirageflow.config",
        "import time:       10 |         10 | tabulate",
        "import time:       10 |         10 |   json.decoder",
        "import time:       10 |         10 | json",
    ])  # fmt: skip
    assert gpu_check.importtime_distributions(text) == {
        "transformers": "mirageflow.config",
        "jsonschema": "mirageflow.config",
        "tabulate": "(top level)",
    }


def test_the_gpu_profile_is_the_slurm_profile_but_the_memory_fudge_flag():
    main = yaml.safe_load((REPO / "profiles" / "slurm" / "profile.yaml").read_text())
    gpu = yaml.safe_load((REPO / "profiles" / "slurm-gpu" / "profile.yaml").read_text())
    assert main.pop("slurm-disable-memory-fudge") is True
    assert gpu == main


def test_mmirage_picks_the_profile_its_slurm_plugin_understands():
    from mirageflow.cli import default_slurm_profile

    assert default_slurm_profile("2.8.0").name == "slurm"
    assert default_slurm_profile("2.7.0").name == "slurm"
    assert default_slurm_profile("2.6.1").name == "slurm-gpu"
    assert default_slurm_profile("").name == "slurm"  # no plugin: the documented default
