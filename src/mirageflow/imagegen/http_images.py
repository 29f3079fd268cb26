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
reached fail the shard (every row would fail). The launched diffusion server that exits or
freezes is restarted in the job like a launched LLM server (engines/server_restarts.py:
``max_restarts``, ``hang_seconds``), and the image requests it held are sent again. The HTTP layer is the transport room
(transport/: its one retry policy and classification of statuses). The key
(``api_key_env``) is sent as a Bearer token to base_url's origin only (an image URL the
answer names elsewhere, or a redirect, is fetched without it) and never written.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

from mirageflow.config.types import ImageGenProcessor
from mirageflow.engines.base import EngineError
from mirageflow.engines.server_process import LOG_TAIL_LINES, ServerProcess
from mirageflow.engines.server_restarts import Restartable, ServerSupervisor
from mirageflow.errors import MirageflowError, RowErrorClass as E
from mirageflow.imagegen.base import ImageError, ImageGenerator, ImageJob, decode_b64, decode_image
from mirageflow.redact import redact, redact_text
from mirageflow.transport.fetch import get_url
from mirageflow.transport.http_client import DeadlineExceeded, HTTPClient, ResponseTooLarge, TransportError, dumps
from mirageflow.transport.retry import PermanentStatus, RetriesExhausted, RetryPolicy, error_message, send_with_retries

log = logging.getLogger(__name__)

_POLICY_MARKERS = ("content_policy", "content policy", "safety", "moderation", "content_filter")
SGLANG_LAUNCHER = ["-m", "sglang.multimodal_gen.runtime.launch_server"]
SGLANG_INSTALL = 'pip install "sglang[diffusion]==0.5.23" (a GPU environment: see docs/gpu-install.md)'


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
        self._credentials: dict[str, str] = {}
        # id(event loop) -> (HTTPClient, the loop, its base_url): its connections belong to that loop
        self._clients: dict[int, tuple] = {}
        self._stale: list[HTTPClient] = []  # clients of a base_url no longer served (a restarted server's), closed at the end

    def load(self) -> None:
        name = self.processor.api_key_env
        if name:
            key = os.environ.get(name)
            if not key:
                raise GeneratorFailed(f"image_gen: the environment variable {name} (api_key_env) is not set or empty")
            self._credentials["Authorization"] = f"Bearer {key}"  # base_url's origin only (transport/http_client.py)
        try:
            HTTPClient(self.base_url)
        except ValueError as e:
            raise GeneratorFailed(f"image_gen: base_url: {e}") from None
        self.info = {
            "backend": self.backend, "base_url": redact_text(self.base_url), "api_key_env": name,
            "max_concurrent_requests": self.concurrency, "timeout_seconds": self.processor.timeout_seconds,
        }  # fmt: skip

    def _client(self) -> HTTPClient:
        """This event loop's client (at most ``max_concurrent_requests`` requests at once)."""
        loop, base_url = asyncio.get_running_loop(), self.base_url
        found = self._clients.get(id(loop))
        if found is None or found[1] is not loop or found[2] != base_url:
            if found is not None and found[1] is loop:
                self._stale.append(found[0])  # requests may still be unwinding on it
            client = HTTPClient(
                base_url, credentials=self._credentials, max_connections=self.concurrency,
                timeout=float(self.processor.timeout_seconds),
            )  # fmt: skip
            found = self._clients[id(loop)] = (client, loop, base_url)
        return found[0]

    async def generate(self, job: ImageJob):
        return await self._generate(job)

    async def _generate(self, job: ImageJob, on_transport_error=None):
        """``generate``; ``on_transport_error`` is asked after a connection error (a launched server's death)."""
        client = self._client()
        data = await self._post(client, request_body(job, self.processor.request_model), on_transport_error)
        what = f"{redact_text(self.base_url)}/images/generations"
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list) or not items or not isinstance(items[0], dict):
            raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: the answer has no data[0] ({str(data)[:200]})")
        item = items[0]
        if item.get("b64_json") is not None:
            return await asyncio.to_thread(decode_b64, item["b64_json"], what)
        if item.get("url"):
            raw = await self._fetch(client, str(item["url"]))
            return await asyncio.to_thread(decode_image, raw, what)
        raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: data[0] holds neither b64_json nor url")

    async def _post(self, client: HTTPClient, body: dict, on_transport_error=None) -> dict:
        what = f"POST {redact_text(self.base_url)}/images/generations"
        timeout = float(self.processor.timeout_seconds)
        policy = RetryPolicy(int(self.processor.max_retries), self.retry_base_delay, self.retry_max_delay, timeout, "timeout_seconds")
        try:
            response = await send_with_retries(
                client, "POST", "/images/generations", dumps(body), policy=policy, what=what, permanent_raises=True,
                on_transport_error=on_transport_error,
            )  # fmt: skip
        except PermanentStatus as e:
            raise GeneratorFailed(f"{e} (check base_url, the model and the key)") from None
        except RetriesExhausted as e:
            if isinstance(e.last_error, DeadlineExceeded):
                raise ImageError(
                    E.IMAGE_TIMEOUT, f"{what}: no image within timeout_seconds={timeout:g} (after {policy.retries} retries)"
                ) from None
            if e.last_error is not None:
                raise GeneratorFailed(f"{what}: the images server cannot be reached ({e}){self._why_gone()}") from None
            raise ImageError(E.IMAGE_GENERATION_FAILED, str(e)) from None
        except ResponseTooLarge as e:
            raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: {e}") from None
        status = response.status_code
        if 200 <= status < 300:
            try:
                return response.json()
            except ValueError:
                raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: the answer is not JSON ({response.text[:200]!r})") from None
        low = response.text.lower()
        kind = E.CONTENT_FILTER if any(m in low for m in _POLICY_MARKERS) else E.IMAGE_GENERATION_FAILED
        raise ImageError(kind, f"{what}: HTTP {status}: {error_message(response.content)}")

    async def _fetch(self, client: HTTPClient, url: str) -> bytes:
        """The image at a URL the answer named: with the key only on base_url's origin, never
        elsewhere nor after a redirect (OpenAI answers with URLs on its blob storage)."""
        try:
            response = await get_url(client, url, timeout=float(self.processor.timeout_seconds))
        except TransportError as e:  # the row's image is not there
            raise ImageError(E.IMAGE_UNDECODABLE, f"GET {redact_text(url)}: {type(e).__name__}: {e}") from None
        if not 200 <= response.status_code < 300:
            raise ImageError(E.IMAGE_UNDECODABLE, f"GET {redact_text(url)}: HTTP {response.status_code}")
        return response.content

    def _why_gone(self) -> str:
        return ""

    async def aclose(self) -> None:
        found = self._clients.pop(id(asyncio.get_running_loop()), None)
        stale, self._stale = self._stale, []
        for client in [*stale, *([found[0]] if found is not None else [])]:
            await client.aclose()

    def close(self) -> None:
        for client in [*self._stale, *(found[0] for found in self._clients.values())]:
            client.close()  # idle connections closed now; one in use closes when its request ends
        self._clients.clear()
        self._stale = []


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


class SGLangDiffusionServer(Restartable, ExternalImages):
    """SGLang's diffusion server as a child of the shard job, launched, health-checked,
    restarted when it dies or freezes (engines/server_restarts.py) and stopped (its whole
    process tree) by the one launcher, engines/server_process.py."""

    backend = "sglang"
    health_poll_interval = 0.2
    kill_grace = 30.0
    host = "127.0.0.1"

    def __init__(self, processor: ImageGenProcessor, log_dir=None):
        super().__init__(processor)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mirageflow-sglang-diffusion-"))
        self.log_path = self.log_dir / "sglang_diffusion_server.log"
        self.supervisor: ServerSupervisor | None = None

    @property
    def server(self) -> ServerProcess | None:
        """The server serving now (the dead one while a restart is under way)."""
        return self.supervisor.server if self.supervisor is not None else None

    def command(self, port: int) -> list[str]:
        p = self.processor
        launcher = list(p.server_command) if p.server_command else [sys.executable, *SGLANG_LAUNCHER]
        return [
            *launcher,
            "--model-path",
            p.model_path,
            "--host",
            self.host,
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
        p = self.processor
        self.supervisor = supervisor = ServerSupervisor(
            "SGLang's diffusion server", self.command, self.log_path, None, host=self.host, ready_path="/health",
            probe_path="/health", start_timeout=float(p.startup_timeout_seconds), poll_interval=self.health_poll_interval,
            kill_grace=self.kill_grace, max_restarts=p.max_restarts, hang_seconds=p.hang_seconds,
            start_timeout_name="startup_timeout_seconds",
        )  # fmt: skip
        supervisor.on_restarted = self._on_restarted
        try:
            supervisor.start_process()
            log.info("starting SGLang's diffusion server: %s (log: %s)", self.server.shown_command(), self.log_path)
            self.base_url = f"{supervisor.base_url}/v1"
            try:  # GET /health answers 200 once the server has warmed up (503 before)
                supervisor.wait_started()
            except EngineError as e:
                raise GeneratorFailed(str(e)) from None
            super().load()
            supervisor.watch()
        except BaseException:
            self.close()
            raise
        self.info.update({
            "server_command": redact(self.server.command), "log": str(self.log_path), "pid": self.server.pid,
            "max_restarts": p.max_restarts, "hang_seconds": p.hang_seconds,
        })  # fmt: skip

    def _on_restarted(self, server: ServerProcess, base_url: str) -> None:
        """A successor serves at ``base_url``: later requests go there (each loop's next client)."""
        self.base_url = f"{base_url}/v1"

    async def generate(self, job: ImageJob):
        """One image; when the server it was asked of dies, asked again of its successor (only a
        request the dead server held: an answered one is never asked again)."""
        supervisor = self.supervisor

        async def send():
            server = supervisor.server
            return await self._generate(job, on_transport_error=lambda: supervisor.check_alive(server))

        return await supervisor.call(send)

    def _why_gone(self) -> str:
        rc = self.server.poll() if self.server is not None else None
        if rc is None:
            return ""
        return f": the server exited with code {rc}; last {LOG_TAIL_LINES} lines of {self.log_path}:\n{redact_text(self.server.tail())}"

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()  # no more restarts
            if self.server is not None:
                self.server.terminate()

    def close(self) -> None:
        super().close()
        if self.supervisor is not None:
            self.supervisor.kill()
