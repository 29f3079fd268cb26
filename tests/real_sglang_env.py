"""The environment of the real-sglang contract tests (tests/test_real_sglang.py).

    python tests/real_sglang_env.py build    # idempotent; prints the time it took
    python tests/real_sglang_env.py python   # the interpreter path

A virtual environment at build/venv-sglang (git-ignored) that sees the packages of the
interpreter that builds it (our CPU torch, transformers, tokenizers): ``--system-site-packages``
for a system Python, and a ``.pth`` file naming the running environment's site directories
when that interpreter is itself a virtualenv's (as the README's Quick start makes one),
whose base interpreter has none of them; it adds
sglang 0.5.23 without its ~200 GPU dependencies (no CUDA wheels: ~1 min, not ~8 and
~11 GB), plus only what importing these modules needs: ``sglang.srt.server_args``,
``srt.managers.schedule_batch`` (FINISH_*), ``srt.managers.tokenizer_manager``,
``srt.observability.metrics_collector``, ``srt.entrypoints.engine``/``api_contract``,
``srt.sampling.sampling_params`` and ``fastapi``. Pins: what ``pip install -r
requirements-gpu.txt`` resolves to.

torchvision is a stub: PyPI has no CPU build for our torch and its CUDA build does not
import without CUDA torch; sglang imports it only in its multimodal utilities, at module
level. The stub's placeholders are inert; nothing the tests call touches them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "build" / "venv-sglang"
PYTHON = VENV / "bin" / "python"
SGLANG = "sglang==0.5.23"
# installed without their dependencies (they would pull CUDA torch and GPU libraries)
NO_DEPS = [SGLANG, "triton==3.8.0", "compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11"]
# installed with their (small, pure Python) dependencies
WITH_DEPS = [
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "uvloop==0.23.0", "pyzmq==27.3.0",
    "msgspec==0.23.0", "pybase64==1.5.1", "aiohttp==3.14.5", "openai==2.8.0", "httpx==0.28.1",
    "partial-json-parser==0.2.1.1.post7", "setproctitle==1.3.8", "sentencepiece==0.2.1", "loguru==0.7.3",
    "einops==0.8.2", "opentelemetry-api==1.45.2", "prometheus-client", "psutil", "pydantic", "orjson",
    "regex", "scipy", "pillow", "requests", "ipython",
]  # fmt: skip
IMPORTS = [
    "sglang", "sglang.srt.server_args", "sglang.srt.managers.schedule_batch", "fastapi",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.observability.metrics_collector",
    "sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.api_contract", "sglang.srt.sampling.sampling_params",
]  # fmt: skip

_STUB = '''"""STUB torchvision for mirageflow's real-sglang contract tests (tests/real_sglang_env.py)."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"
__path__ = []


class _Any:
    def __init__(self, name="stub"):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(name)

    def __call__(self, *args, **kwargs):
        return _Any(self._name)

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Any(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
'''


def check() -> str | None:
    """None when every module imports, else the error."""
    if not PYTHON.exists():
        return f"{PYTHON} does not exist (run: python tests/real_sglang_env.py build)"
    code = "import importlib, warnings; warnings.simplefilter('ignore')\n" + "".join(f"importlib.import_module({m!r})\n" for m in IMPORTS)
    proc = subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, cwd="/")
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]


def running_site_dirs() -> list[str]:
    """This interpreter's site directories (a virtualenv's own, and its base's when it sees them)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def see_running_environment(site: Path) -> None:
    """In a virtualenv, ``--system-site-packages`` shows the new one its *base* interpreter's
    packages, not the virtualenv's (torch, transformers): name those in a .pth file (read
    after the new environment's own site-packages, so its sglang comes first)."""
    pth = site / "mirageflow-running-env.pth"
    if sys.prefix == sys.base_prefix:  # a system Python: --system-site-packages is enough
        pth.unlink(missing_ok=True)
        return
    pth.write_text("".join(d + "\n" for d in running_site_dirs() if Path(d).resolve() != site.resolve()))


def venv_site(venv: Path) -> Path:
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def make_venv(venv: Path, *flags: str) -> Path:
    """A new virtualenv at ``venv`` that sees this interpreter's packages; its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", *flags, str(venv)], check=True)
    site = venv_site(venv)
    see_running_environment(site)
    return site


def build() -> None:
    t0 = time.monotonic()
    if check() is None:
        print(f"real-sglang env: {VENV} is ready ({SGLANG})")
        return
    pip = [str(PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    has_pip = PYTHON.exists() and subprocess.run([str(PYTHON), "-m", "pip", "--version"], capture_output=True).returncode == 0
    if not has_pip:  # none yet, or one whose creation was killed half-way (no pip): start it over
        make_venv(VENV)
    site = venv_site(VENV)
    see_running_environment(site)  # again (an env built before): before pip, which must find our torch installed
    subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True)
    subprocess.run([*pip, *WITH_DEPS], check=True)
    stub = site / "torchvision"
    stub.mkdir(exist_ok=True)
    (stub / "__init__.py").write_text(_STUB)
    error = check()
    if error:
        sys.exit(f"real-sglang env: built, but an import fails: {error}")
    print(f"real-sglang env: built {VENV} ({SGLANG}) in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        build()
    elif sys.argv[1:] == ["python"]:
        print(PYTHON)
    else:
        sys.exit(__doc__)
