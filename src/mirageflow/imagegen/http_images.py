"""Images over HTTP: an OpenAI-compatible images endpoint (``backend: external``) and SGLang's
diffusion server launched by the shard job (``backend: sglang``).

One image per request: ``POST {base_url}/images/generations`` with ``{"prompt", "n": 1,
"response_format": "b64_json", "size": "WxH", "seed", "negative_prompt",
"num_inference_steps", "guidance_scale", "model"}`` (the keys that are set; SGLang's
ImageGenerationsRequest takes them all, sglang 0.5.23
multimodal_gen/runtime/entrypoints/openai/protocol.py), answered by ``{"data": [{"b64_json"}]}``
(or a ``url``, fetched). Up to ``max_concurrent_requests`` at once (1 without
``parallel_inference``).

Errors: a content-policy refusal (HTTP 400 whose error says content_policy / safety) is the
row error ``content_filter``; any other 4xx ``image_generation_failed``; a timeout
(``timeout_seconds`` per attempt), 429 and 5xx are retried ``max_retries`` times with
backoff, then the row fails (``image_timeout``, ``image_generation_failed``); an answer
without a readable image is ``image_undecodable``. 401, 403, 404 and a server that cannot be
reached fail the shard (every row would fail). The key (``api_key_env``) is sent as a
Bearer token and never written.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from mirageflow.config.types import ImageGenProcessor
from mirageflow.engines.http import backoff_delay, error_message, free_port
from mirageflow.errors import MirageflowError
from mirageflow.imagegen.base import ImageError, ImageGenerator, ImageJob, decode_b64, decode_image
from mirageflow.redact import redact, redact_text

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
FATAL_STATUS = {401, 403, 404}
_POLICY_MARKERS = ("content_policy", "content policy", "safety", "moderation", "content_filter")
SGLANG_LAUNCHER = ["-m", "sglang.multimodal_gen.runtime.launch_server"]
SGLANG_INSTALL = 'pip install "sglang[diffusion]==0.5.23" (a GPU environment: see the README\'s GPU section)'
LOG_TAIL_LINES = 30


class GeneratorFailed(MirageflowError, RuntimeError):
    """The images server is unusable (unreachable, refused the key, gone): the shard fails."""


def request_body(job: ImageJob, model: str | None) -> dict:
    """The JSON body of one image request."""
    body: dict = {"prompt": job.prompt, "n": 1, "response_format": "b64_json"}
    if model:
        body["model"] = model
    if job.width and job.height:
        body["size"] = f"{int(job.width)}x{int(job.height)}"
    if job.seed is not None:
        body["seed"] = int(job.seed)
    if job.negative_prompt:
        body["negative_prompt"] = job.negative_prompt
    for key in ("num_inference_steps", "guidance_scale"):
        if job.params.get(key) is not None:
            body[key] = job.params[key]
    return body


class ExternalImages(ImageGenerator):
    backend = "external"
    retry_base_delay = 1.0
    retry_max_delay = 30.0

    def __init__(self, processor: ImageGenProcessor):
        super().__init__()
        self.processor = processor
        self.base_url = (processor.base_url or "").rstrip("/")
        self.concurrency = processor.max_concurrent_requests if processor.parallel_inference else 1
        self.max_inflight = max(self.concurrency * 2, 8)
        self._headers: dict[str, str] = {}
        self._clients: dict[int, tuple] = {}  # id(event loop) -> (httpx2 client, semaphore)

    def load(self) -> None:
        import httpx2  # noqa: F401 - fail at load when missing

        name = self.processor.api_key_env
        if name:
            key = os.environ.get(name)
            if not key:
                raise GeneratorFailed(f"image_gen: the environment variable {name} (api_key_env) is not set or empty")
            self._headers["Authorization"] = f"Bearer {key}"
        self.info = {
            "backend": self.backend, "base_url": redact_text(self.base_url), "api_key_env": name,
            "max_concurrent_requests": self.concurrency, "timeout_seconds": self.processor.timeout_seconds,
        }  # fmt: skip

    def _client(self):
        """This event loop's client (httpx2 clients and semaphores belong to the loop that made them)."""
        import httpx2

        loop = asyncio.get_running_loop()
        found = self._clients.get(id(loop))
        if found is None or found[2] is not loop:
            client = httpx2.AsyncClient(headers=self._headers, timeout=float(self.processor.timeout_seconds), follow_redirects=True)
            found = self._clients[id(loop)] = (client, asyncio.Semaphore(self.concurrency), loop)
        return found[0], found[1]

    async def generate(self, job: ImageJob):
        client, semaphore = self._client()
        async with semaphore:
            data = await self._post(client, request_body(job, self.processor.request_model))
            what = f"{redact_text(self.base_url)}/images/generations"
            items = data.get("data") if isinstance(data, dict) else None
            if not isinstance(items, list) or not items or not isinstance(items[0], dict):
                raise ImageError("image_undecodable", f"{what}: the answer has no data[0] ({str(data)[:200]})")
            item = items[0]
            if item.get("b64_json") is not None:
                return await asyncio.to_thread(decode_b64, item["b64_json"], what)
            if item.get("url"):
                raw = await self._fetch(client, item["url"])
                return await asyncio.to_thread(decode_image, raw, what)
            raise ImageError("image_undecodable", f"{what}: data[0] holds neither b64_json nor url")

    async def _post(self, client, body: dict) -> dict:
        import httpx2

        url = f"{self.base_url}/images/generations"
        what = f"POST {redact_text(url)}"
        timeout = float(self.processor.timeout_seconds)
        last_kind, last = "image_generation_failed", ""
        for attempt in range(int(self.processor.max_retries) + 1):
            retry_after = None
            try:
                response = await asyncio.wait_for(client.post(url, json=body), timeout)
            except asyncio.TimeoutError:
                last_kind, last = "image_timeout", f"no image within timeout_seconds={timeout:g}"
            except httpx2.TransportError as e:
                if isinstance(e, httpx2.TimeoutException):
                    last_kind, last = "image_timeout", f"no image within timeout_seconds={timeout:g}"
                else:
                    last_kind, last = "unreachable", f"{type(e).__name__}: {e}"
            else:
                status = response.status_code
                if 200 <= status < 300:
                    try:
                        return response.json()
                    except ValueError:
                        raise ImageError("image_undecodable", f"{what}: the answer is not JSON ({response.text[:200]!r})") from None
                message = error_message(response.content)
                if status in FATAL_STATUS:
                    raise GeneratorFailed(f"{what}: HTTP {status}: {message} (check base_url, the model and the key)")
                if status not in RETRY_STATUS:
                    low = response.text.lower()
                    kind = "content_filter" if any(m in low for m in _POLICY_MARKERS) else "image_generation_failed"
                    raise ImageError(kind, f"{what}: HTTP {status}: {message}")
                last_kind, last = "image_generation_failed", f"HTTP {status}: {message}"
                retry_after = response.headers.get("retry-after")
            if attempt < self.processor.max_retries:
                await asyncio.sleep(backoff_delay(attempt, self.retry_base_delay, self.retry_max_delay, retry_after))
        if last_kind == "unreachable":
            raise GeneratorFailed(f"{what}: the images server cannot be reached ({last}){self._why_gone()}")
        raise ImageError(last_kind, f"{what}: {last} (after {self.processor.max_retries} retries)")

    async def _fetch(self, client, url: str) -> bytes:
        try:
            response = await asyncio.wait_for(client.get(url), float(self.processor.timeout_seconds))
        except Exception as e:  # noqa: BLE001 - the row's image is not there
            raise ImageError("image_undecodable", f"GET {redact_text(url)}: {type(e).__name__}: {e}") from None
        if not 200 <= response.status_code < 300:
            raise ImageError("image_undecodable", f"GET {redact_text(url)}: HTTP {response.status_code}")
        return response.content

    def _why_gone(self) -> str:
        return ""

    async def aclose(self) -> None:
        found = self._clients.pop(id(asyncio.get_running_loop()), None)
        if found is not None:
            await found[0].aclose()

    def close(self) -> None:
        for client, _, loop in list(self._clients.values()):
            if not loop.is_closed() and not loop.is_running():
                try:
                    loop.run_until_complete(client.aclose())
                except Exception:  # noqa: BLE001 - closing goes on
                    log.debug("closing the images client failed", exc_info=True)
        self._clients.clear()


def sglang_diffusion_missing() -> str | None:
    """Why this interpreter cannot run SGLang's diffusion server, or None (no import: a look
    at the installed package's files)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return f"the sglang package is not installed here ({SGLANG_INSTALL})"
    root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "multimodal_gen" / "runtime" / "launch_server.py").is_file():
        return f"the installed sglang ({root}) has no diffusion server (sglang.multimodal_gen; sglang 0.5.23 has one: {SGLANG_INSTALL})"
    if importlib.util.find_spec("diffusers") is None:
        return f"sglang's diffusion server needs the diffusers package, which is not installed here ({SGLANG_INSTALL})"
    return None


class SGLangDiffusionServer(ExternalImages):
    """SGLang's diffusion server as a child of the shard job, in its own process group."""

    backend = "sglang"
    health_poll_interval = 0.2
    kill_grace = 30.0

    def __init__(self, processor: ImageGenProcessor, log_dir=None):
        super().__init__(processor)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mirageflow-sglang-diffusion-"))
        self.log_path = self.log_dir / "sglang_diffusion_server.log"
        self.process: subprocess.Popen | None = None
        self._log_offset = 0

    def command(self, port: int) -> list[str]:
        p = self.processor
        launcher = list(p.server_command) if p.server_command else [sys.executable, *SGLANG_LAUNCHER]
        return [
            *launcher,
            "--model-path",
            p.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-gpus",
            str(p.num_gpus),
            *p.extra_server_args,
        ]

    def load(self) -> None:
        if not self.processor.server_command:
            missing = sglang_diffusion_missing()
            if missing:
                raise GeneratorFailed(f"image_gen backend sglang: {missing}")
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}/v1"
        cmd = self.command(port)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log.info("starting SGLang's diffusion server: %s (log: %s)", " ".join(redact(cmd)), self.log_path)
        with open(self.log_path, "ab") as logf:
            self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(f"http://127.0.0.1:{port}")
            super().load()
        except BaseException:
            self.close()
            raise
        self.info.update({"server_command": redact(cmd), "log": str(self.log_path), "pid": self.process.pid})

    def _wait_healthy(self, root: str) -> None:
        """GET /health answers 200 once the server has warmed up (503 before)."""
        import httpx2

        deadline = time.monotonic() + float(self.processor.startup_timeout_seconds)
        interval = self.health_poll_interval
        with httpx2.Client(timeout=5.0) as client:
            while True:
                rc = self.process.poll()
                if rc is not None:
                    raise GeneratorFailed(f"SGLang's diffusion server exited with code {rc} before it became healthy{self._tail()}")
                try:
                    if client.get(f"{root}/health").status_code == 200:
                        return
                except httpx2.TransportError:
                    pass
                if time.monotonic() >= deadline:
                    raise GeneratorFailed(
                        f"SGLang's diffusion server did not answer GET /health with 200 within "
                        f"startup_timeout_seconds={self.processor.startup_timeout_seconds:g}{self._tail()}"
                    )
                time.sleep(interval)
                interval = min(interval * 1.5, 2.0)

    def _tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                lines = deque(f, maxlen=LOG_TAIL_LINES)
        except OSError:
            return ""
        text = b"".join(lines).decode("utf-8", "replace").rstrip()
        return f"; last {LOG_TAIL_LINES} lines of {self.log_path}:\n{redact_text(text)}" if text else f" ({self.log_path} is empty)"

    def _why_gone(self) -> str:
        rc = self.process.poll() if self.process is not None else None
        return f": the server exited with code {rc}{self._tail()}" if rc is not None else ""

    def stop(self) -> None:
        self._terminate(wait=False)

    def _terminate(self, wait: bool = True) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if not wait:
            return
        try:
            process.wait(timeout=self.kill_grace)
        except subprocess.TimeoutExpired:
            log.warning("SGLang's diffusion server did not stop within %.0f s of SIGTERM: killing it", self.kill_grace)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # also children that outlived the leader
        except ProcessLookupError:
            pass
        process.wait()

    def close(self) -> None:
        super().close()
        self._terminate()
