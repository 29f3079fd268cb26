"""What every image generator takes and gives: an ImageJob in, a decoded RGB image out, or
an ImageError naming the row-error class."""

from __future__ import annotations

import abc
import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any

from mirageflow.errors import MirageflowError, RowErrorClass as E


@dataclass
class ImageJob:
    prompt: str
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    params: dict[str, Any] = field(default_factory=dict)  # num_inference_steps, guidance_scale


class ImageError(MirageflowError):
    """This row's image cannot be had; ``kind`` is its row-error class:
    ``content_filter`` (the server's content policy refused the prompt),
    ``image_timeout`` (no image within the timeout, after the retries),
    ``image_undecodable`` (the answer holds no image Pillow can read), ``image_too_large``
    (its header claims more than MAX_OUTPUT_PIXELS),
    ``image_generation_failed`` (the server answered an error about this request, or
    the pipeline raised on it)."""

    def __init__(self, kind: E, message: str):
        super().__init__(message)
        self.kind = E(kind)  # a name the enum does not know raises here, where the error is made


# the most pixels a generated image may have: read from its header before it is decoded, so
# a decompression bomb (a 58-byte BMP claiming 100000 x 100000) is this row's error
MAX_OUTPUT_PIXELS = 8192 * 8192


def decode_image(data: bytes, what: str):
    """Bytes of an image file -> an RGB PIL image, or ImageError naming the row-error class.

    The boundary of one answer's image: whatever decoding it raises (Pillow's plugins raise
    OSError, ValueError, SyntaxError, but also struct.error, IndexError, DecompressionBombError,
    MemoryError...) is this row's ``image_undecodable``; an image of more than
    MAX_OUTPUT_PIXELS is ``image_too_large``, refused from its header. Never the shard's."""
    from PIL import Image

    bomb = f"{what}: the image claims more pixels than Pillow decodes (a decompression bomb)"
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_OUTPUT_PIXELS:
                raise ImageError(
                    E.IMAGE_TOO_LARGE, f"{what}: the image says it is {width} x {height} pixels, more than {MAX_OUTPUT_PIXELS} "
                    "(a decompression bomb?)",
                )  # fmt: skip
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(E.IMAGE_TOO_LARGE, bomb) from None
    except Exception as e:  # noqa: BLE001 - the answer's bytes decide it: this row's error (see above)
        raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: not an image Pillow can read ({type(e).__name__}: {str(e)[:200]})") from None


def decode_b64(text: Any, what: str):
    if not isinstance(text, str):
        raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: b64_json is a {type(text).__name__}, not a string")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(E.IMAGE_UNDECODABLE, f"{what}: b64_json is not base64 ({e})") from None
    return decode_image(data, what)


class ImageGenerator(abc.ABC):
    """Load once, generate image by image (called concurrently from the row path), close."""

    backend = ""
    # rows in flight that wait on this generator (the runner's window without an LLM)
    max_inflight = 64

    def __init__(self) -> None:
        self.info: dict[str, Any] = {"backend": self.backend}

    @abc.abstractmethod
    def load(self) -> None: ...

    @abc.abstractmethod
    async def generate(self, job: ImageJob):
        """The job's image (an RGB PIL image); ImageError for this row; any other exception
        means the generator cannot go on (the shard fails)."""

    async def aclose(self) -> None:  # noqa: B027 - generators without clients of the row loop
        """Close what belongs to the calling event loop (an HTTP client), at the end of generation."""

    def restarts(self) -> int:
        """How many times this job restarted the generator's launched server (engines/server_restarts.py)."""
        return 0

    def deaths(self) -> list[dict]:
        """Each death of the generator's launched server in this job (engines/server_restarts.py)."""
        return []

    def stop(self) -> None:  # noqa: B027 - generators without long calls have nothing to interrupt
        """Interrupt soon (SIGTERM/SIGINT, from any thread)."""

    def close(self) -> None:  # noqa: B027
        pass
