"""MMIRAGE's own pipeline files through `mmirage check`: the workspace they expect, and what we expect of each.

The files are in tests/mmirage_configs/ (see its README.md: the 15 of qchapp/MMIRAGE at
2972ff6 verbatim, with their test data, under their Apache-2.0 licence; and our equivalents
of the api_llm and filter examples of the newer forks). ``workspace`` lays them out as
MMIRAGE's repository root (relative paths in the configs are relative to it), adds the data
the experiment configs read through environment variables, and a HOME for their
``hf_home: ~/hf``. Their hub model ids are served by a stand-in hub (tests/fakes/fake_hub.py)
holding the tiny test models under those names, with the real models' context lengths.

Run as a script to measure a source tree (the number of configs accepted):

    python tests/mmirage_conformance.py [--src DIR]

(`--src` defaults to this checkout's src/; the PYTHONPATH of each `mmirage check`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "mmirage_configs"
UPSTREAM = FIXTURES / "qchapp-2972ff6"
EQUIVALENTS = FIXTURES / "equivalents"


@dataclass(frozen=True)
class Expected:
    config: str  # path relative to the workspace (MMIRAGE's repository root)
    accepted: bool
    refused_key: str | None = None  # the key path the refusal names
    why: str | None = None  # why it is refused for now, and the issue that changes it


EXPECTED = [
    Expected("configs/config_benchmark_datatrove.yaml", True),
    Expected("configs/config_comprehensive.yaml", True),
    Expected("configs/config_mock.yaml", True),
    Expected("configs/config_mock_custom_module.yaml", True),
    Expected("configs/config_mock_vision.yaml", True),
    Expected("experiments/recovery/configs/mmirage_recovery.yaml", True),
    Expected("experiments/vlm_enrichment/configs/mmirage_vlm.yaml", True),
    Expected(
        "experiments/sglang_overhead/configs/mmirage_sglang.yaml",
        False,
        "processors[0].default_sampling_params.max_tokens",
        "max_tokens is not an SGLang sampling parameter (SGLang itself rejects it; max_new_tokens is)",
    ),
    Expected("configs/config_mock_openai_batch.yaml", True),
    Expected("configs/config_mock_openai_batch_vision.yaml", True),
    Expected("configs/config_mock_anthropic_batch.yaml", True),
    Expected("configs/config_mock_anthropic_batch_vision.yaml", True),
    Expected("configs/config_image_gen_external.yaml", True),
    Expected("configs/config_image_gen_sglang.yaml", True),
    Expected("configs/config_mock_image_gen_local.yaml", True),
    # ours, equivalent to the newer forks' examples (every key they use)
    Expected("configs/config_mock_api_llm.yaml", True),
    Expected("configs/config_mock_filter.yaml", True),
]
UPSTREAM_COUNT = 15

# Hub ids the configs name -> (which tiny model serves it, the real model's context length)
HUB_IDS = {
    "Qwen/Qwen3-4B": ("llm", 40960),
    "Qwen/Qwen3-4B-Instruct-2507": ("llm", 262144),
    "Qwen/Qwen3-VL-8B-Instruct": ("vlm", 262144),
    "Qwen/Qwen3-VL-4B-Instruct": ("vlm", 262144),
}


def hub_repos(tiny_llm: Path, tiny_vlm: Path) -> dict:
    from fakes.fake_hub import repo_from_dir

    from fakes.fake_hub import HubRepo

    dirs = {"llm": tiny_llm, "vlm": tiny_vlm}
    repos = {
        repo_id: repo_from_dir(dirs[kind], config_overrides={"max_position_embeddings": context})
        for repo_id, (kind, context) in HUB_IDS.items()
    }
    # config_image_gen_sglang.yaml's diffusion pipeline: the driver fetches it as it fetches language models
    repos["Qwen/Qwen-Image"] = HubRepo(files={"model_index.json": json.dumps({"_class_name": "QwenImagePipeline"}).encode()})
    return repos


def workspace(root: Path, tiny_llm: Path) -> tuple[Path, dict]:
    """MMIRAGE's repository root with every config's data; the environment variables they read."""
    ws = root / "mmirage"
    shutil.copytree(UPSTREAM, ws)
    shutil.copytree(EQUIVALENTS, ws, dirs_exist_ok=True)
    home = root / "home"
    home.mkdir()
    # config_benchmark_datatrove.yaml: a save_to_disk copy of s1K-1.1 (its `question` column)
    from datasets import Dataset

    Dataset.from_dict({"question": [f"What is {i} + {i}?" for i in range(8)]}).save_to_disk(str(ws / "data" / "s1K-1.1"))
    exp = ws / "experiment_data"
    exp.mkdir()
    _jsonl(exp / "recovery.jsonl", [
        {"stable_id": f"r{i}", "source_index": i, "prompt_text": f"Tell me about the number {i}.", "prompt_sha256": f"{i:064x}"}
        for i in range(20)
    ])  # fmt: skip
    _jsonl(exp / "overhead.jsonl", [{"source_index": i, "question": f"q{i}", "prompt_text": f"Count to {i}."} for i in range(4)])
    images = sorted(p.name for p in (ws / "tests" / "mock_data_vision").glob("*.jpg"))
    _jsonl(exp / "vlm.jsonl", [{"id": f"m{i}", "caption": f"an image of {name}", "image_path": name} for i, name in enumerate(images)])
    env = {
        "HOME": str(home),
        "MMIRAGE_RECOVERY_STATE_DIR": str(root / "out" / "recovery" / "state"),
        "MMIRAGE_RECOVERY_INPUT_JSONL": str(exp / "recovery.jsonl"),
        "MMIRAGE_RECOVERY_OUTPUT_DIR": str(root / "out" / "recovery" / "data"),
        "MMIRAGE_OVERHEAD_MODEL_PATH": str(tiny_llm),
        "MMIRAGE_OVERHEAD_STATE_DIR": str(root / "out" / "overhead" / "state"),
        "MMIRAGE_OVERHEAD_PROMPTS_JSONL": str(exp / "overhead.jsonl"),
        "MMIRAGE_OVERHEAD_OUTPUT_DIR": str(root / "out" / "overhead" / "data"),
        "MMIRAGE_VLM_STATE_DIR": str(root / "out" / "vlm" / "state"),
        "MMIRAGE_VLM_INPUT_JSONL": str(exp / "vlm.jsonl"),
        "MMIRAGE_VLM_OUTPUT_DIR": str(root / "out" / "vlm" / "data"),
        "MMIRAGE_VLM_IMAGE_BASE_PATH": str(ws / "tests" / "mock_data_vision"),
        "MMIRAGE_VLM_NUM_SHARDS": "2",
        "MMIRAGE_VLM_SHARD_ID": "0",
        "MMIRAGE_VLM_BATCH_SIZE": "4",
        # the configs are checked, not run: the GPU engines they name (sglang) are not in this
        # environment, whose missing-package refusal tests/test_preflight.py covers
        "MIRAGEFLOW_SKIP_ENGINE_CHECK": "1",
        # the api_llm and batch_api examples' keys (names only: `mmirage check` refuses an unset one)
        "OPENROUTER_API_KEY": "sk-test",
        "OPENAI_API_KEY": "sk-test",
        "ANTHROPIC_API_KEY": "sk-test",
    }
    return ws, env


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def check_env(env: dict, hub_url: str, src: Path) -> dict:
    """The environment of one `mmirage check`: the workspace's variables, the stand-in hub, no token."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    out.update(env)
    out["HF_ENDPOINT"] = hub_url
    out["PYTHONPATH"] = str(src)
    return out


def run_check(ws: Path, config: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", "check", "--config", config],
        cwd=ws, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(HERE.parent / "src"), help="the source tree whose `mmirage check` is measured")
    ap.add_argument("-v", action="store_true", help="print each refusal")
    args = ap.parse_args(argv)
    from fakes.fake_hub import FakeHub
    from mirageflow.model_prep import build_tiny_llama, build_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        llm, vlm = build_tiny_llama(root / "tiny-llm"), build_tiny_vlm(root / "tiny-vlm")
        hub = FakeHub(hub_repos(llm, vlm)).start()
        ws, env = workspace(root, llm)
        accepted = {"upstream": 0, "equivalents": 0}
        for exp in EXPECTED:
            proc = run_check(ws, exp.config, check_env(env, hub.url, Path(args.src)))
            ok = proc.returncode == 0
            group = "equivalents" if (EQUIVALENTS / exp.config).exists() else "upstream"
            accepted[group] += ok
            print(f"{'accepted' if ok else 'refused '}  {exp.config}")
            if not ok and args.v:
                print("    " + (proc.stdout + proc.stderr).strip().replace("\n", "\n    ")[:1500])
        hub.stop()
    print(f"upstream (qchapp/MMIRAGE@2972ff6): {accepted['upstream']} of {UPSTREAM_COUNT} accepted")
    print(f"equivalents of the newer forks' examples: {accepted['equivalents']} of {len(EXPECTED) - UPSTREAM_COUNT} accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
