"""A stand-in images server on 127.0.0.1: OpenAI's ``POST /v1/images/generations``
(https://platform.openai.com/docs/api-reference/images/create: ``{prompt, n, size,
response_format}`` -> ``{"created", "data": [{"b64_json"}]}``) with SGLang's extensions
(``seed``, ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``: sglang 0.5.23
multimodal_gen/runtime/entrypoints/openai/protocol.py ImageGenerationsRequest), and
``GET /health`` (200; 503 for ``warmup_seconds`` after start, as SGLang's diffusion server
before its warmup is done).

The image is a PNG of the requested size (default 64x64) filled with a colour drawn from
the seed (random without one), so equal seeds give equal images. Markers in the prompt:
``FAIL_POLICY`` (400, code content_policy_violation), ``BAD_IMAGE`` (b64_json that is not an
image), ``NOT_B64`` (b64_json that is not base64), ``SLOW`` (sleeps ``slow_seconds`` first),
``FAIL_SERVER`` (500), ``BOMB_IMAGE`` (a decompression bomb: a 58-byte BMP header that
claims 100000 x 100000 pixels). ``fatal_after``: after that many answers every request is a 401 (a
revoked key). ``api_key``: a Bearer token required when set. Counters: ``requests``,
``bodies``.

Run as a script it takes SGLang's diffusion server flags (``--model-path M --host H --port
P --num-gpus N``) and serves until killed: the ``server_command`` of backend sglang in tests.
Its deaths come from the environment, as the stand-in vLLM's (fake_http.this_starts_death):
``FAKE_IMAGES_DEATHS=kill:4,freeze:3,exit,...`` (the k-th start, counted in the file
``FAKE_IMAGES_STARTS``, SIGKILLs or SIGSTOPs itself on the image request after n answers, or
exits with code 4 before serving), ``FAKE_IMAGES_REQUEST_LOG`` (a JSON line per image request
asked and answered: pid, prompt, seed, n).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

try:
    from fakes.fake_http import LocalHTTPServer, _log_request, this_starts_death
except ImportError:  # run as a script from tests/fakes (an SGLang diffusion server stand-in)
    from fake_http import LocalHTTPServer, _log_request, this_starts_death


@dataclass
class Behaviour:
    slow_seconds: float = 5.0
    fatal_after: int | None = None
    api_key: str | None = None
    warmup_seconds: float = 0.0
    bodies: list = field(default_factory=list)
    url_base: str | None = None  # answer data[0].url on this origin (another FakeImages' /img/...) instead of b64_json
    death: tuple[str, int] | None = None  # ("kill" | "freeze", n): on the image request after n answers
    request_log: str | None = None  # a JSON line per image request asked and answered


def png(width: int, height: int, seed: int | None) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def bmp_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A BMP file header and info header claiming ``width`` x ``height`` 24-bit pixels, and no pixels: 58 bytes."""
    file_header = struct.pack("<2sIHHI", b"BM", 58, 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 4, 2835, 2835, 0, 0)
    return file_header + info + b"\0\0\0\0"


class FakeImages(LocalHTTPServer):
    def __init__(self, behaviour: Behaviour | None = None, host: str = "127.0.0.1", port: int = 0):
        self.behaviour = behaviour or Behaviour()
        self.listen(host, port, _handler(self))
        self.requests = self.answered = 0
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.get_headers: list[dict] = []  # the headers of every GET (an image host: was a key sent here?)


def _handler(server: FakeImages):
    b = server.behaviour

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            with server.lock:
                server.get_headers.append({k.lower(): v for k, v in self.headers.items()})
            if self.path.startswith("/img/"):  # /img/<W>x<H>-<seed>.png: an image host
                size, _, seed = self.path[5:].removesuffix(".png").partition("-")
                width, height = (int(x) for x in size.split("x"))
                data = png(width, height, int(seed) if seed.isdigit() else None)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return self.wfile.write(data)
            if self.path == "/health":
                ready = time.monotonic() - server.started >= b.warmup_seconds
                return self._send(200 if ready else 503, {"status": "ok"} if ready else {"status": "warming up"})
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/v1/images/generations":
                return self._send(404, {"detail": "Not Found"})
            with server.lock:
                server.requests += 1
                count = server.requests
                b.bodies.append(body)
            _log_request(b.request_log, "asked", body)
            if b.death is not None and server.answered >= b.death[1]:
                print(f"fake images: {b.death[0]} after {server.answered} answers", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if b.death[0] == "kill" else signal.SIGSTOP)
            if b.api_key and self.headers.get("Authorization") != f"Bearer {b.api_key}":
                return self._send(401, {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}})
            if b.fatal_after is not None and count > b.fatal_after:
                return self._send(401, {"error": {"message": "key revoked", "code": "invalid_api_key"}})
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                return self._send(422, {"detail": "prompt is required"})
            if body.get("n", 1) != 1 or body.get("response_format") not in (None, "b64_json", "url"):
                return self._send(400, {"error": {"message": "n must be 1 here", "code": None}})
            if "SLOW" in prompt:
                time.sleep(b.slow_seconds)
            if "FAIL_POLICY" in prompt:
                return self._send(
                    400,
                    {
                        "error": {
                            "message": "Your request was rejected as a result of our safety system.",
                            "type": "image_generation_user_error",
                            "code": "content_policy_violation",
                        }
                    },
                )
            if "FAIL_SERVER" in prompt:
                return self._send(500, {"error": {"message": "internal error", "code": None}})
            width, height = (int(x) for x in str(body.get("size") or "64x64").split("x"))
            if "BAD_IMAGE" in prompt:
                data = base64.b64encode(b"this is not a png").decode()
            elif "BOMB_IMAGE" in prompt:
                data = base64.b64encode(bmp_bomb()).decode()
            elif "NOT_B64" in prompt:
                data = "%%% not base64 %%%"
            elif b.url_base:
                url = f"{b.url_base}/img/{width}x{height}-{body.get('seed')}.png"
                return self._send(200, {"id": f"img-{count}", "created": int(time.time()), "data": [{"url": url}]})
            else:
                data = base64.b64encode(png(width, height, body.get("seed"))).decode()
            self._send(200, {"id": f"img-{count}", "created": int(time.time()), "data": [{"b64_json": data, "revised_prompt": None}]})
            with server.lock:
                server.answered += 1
            _log_request(b.request_log, "answered", body)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description="stand-in for SGLang's diffusion server (its flags)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--warmup-seconds", type=float, default=0.5)
    args, _ = ap.parse_known_args()
    death = this_starts_death(os.environ, "FAKE_IMAGES")
    if death == ("exit", 0):
        print("fake images: torch.OutOfMemoryError: CUDA out of memory", flush=True)
        sys.exit(4)
    behaviour = Behaviour(warmup_seconds=args.warmup_seconds, death=death, request_log=os.environ.get("FAKE_IMAGES_REQUEST_LOG"))
    server = FakeImages(behaviour, host=args.host, port=args.port)
    print(f"stand-in diffusion server for {args.model_path} on {server.url} ({args.num_gpus} GPU(s))", flush=True)
    server.httpd.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
