"""Image inputs for vision-language models: each row's image values loaded, checked and
canonicalised once, then placed into the chat messages where the prompt puts them.

An image input (``processing_params.inputs[].type: image``) holds, per row, one image
source or a list of them (several images per row):

- a path, relative to ``datasets[].image_base_path`` or, without it, to the dataset's
  folder (the JSONL/Parquet file's directory, the ``save_to_disk`` directory); absolute
  paths are used as they are;
- a Hugging Face ``Image`` feature value (Parquet, ``save_to_disk``): ``{"bytes", "path"}``,
  bytes first;
- a ``data:`` URI (``data:image/png;base64,...``);
- an ``http(s)://`` URL, fetched with a 20 s timeout (a job without network gets the row
  error ``image_remote_unreachable``, which says so).

Canonical form (``CanonicalImage``): EXIF orientation applied, RGB (alpha composited on
white), the longest side at most ``max_side`` when set; the source bytes are kept when
nothing had to change (a plain RGB JPEG or PNG), else the result is re-encoded: as JPEG
(quality 95) when the source was a JPEG, else as PNG.
``sha256`` is that of the bytes the model receives.

Hostile values are row errors (stage ``image``) naming the input and the source:
``image_missing`` (no such file), ``image_unreadable`` (not an image, truncated, a
directory, bad base64), ``image_too_large`` (more than ``max_bytes`` bytes or
``max_pixels`` pixels, checked before decoding: a decompression bomb is never decoded),
``image_remote_unreachable`` and ``image_invalid_value`` (a number, an empty list...).

Placement: the prompt names an image variable where its images go (``{{ photo }}``; a list
variable puts all its images there); a prompt that names none gets every image input of
the row at the start of its user turn. The user turn's content then becomes transformers'
multimodal parts ``[{"type": "image"}, {"type": "text", "text": ...}]`` and the request
carries the images in the same order (``Request.images``): the chat template writes one
placeholder per image part, inside the user turn.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from mirageflow.config.types import DatasetConfig, PipelineConfig
from mirageflow.errors import RowError, RowErrorClass as E

STAGE = "image"
DEFAULT_MAX_PIXELS = 36_000_000  # 6000 x 6000; Pillow's own bomb check starts at ~89 M
DEFAULT_MAX_BYTES = 20 << 20  # MMIRAGE's cap on remote images
REMOTE_TIMEOUT_SECONDS = 20.0  # MMIRAGE's
_PASSTHROUGH = {"JPEG": "image/jpeg", "PNG": "image/png"}
_DATA_URI = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,", re.I)
# Stands for an image variable while its prompt renders (private-use code points: never in
# real text), so the rendered text can be cut where the images go.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}([A-Za-z_][A-Za-z0-9_]*){_MARK_CLOSE}")


@dataclass(frozen=True, eq=False)
class CanonicalImage:
    """One image as the model receives it."""

    data: bytes  # JPEG or PNG
    mime: str
    width: int
    height: int
    sha256: str
    source: str  # where it came from, for messages (a path, "data: URI", "bytes")
    image: Any = field(default=None, repr=False)  # the decoded RGB PIL image (transformers uses it)

    def data_uri(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"

    def pil(self):
        if self.image is not None:
            return self.image
        from PIL import Image

        return Image.open(io.BytesIO(self.data)).convert("RGB")


def _error(kind: str, name: str, source: str, message: str) -> RowError:
    return RowError(STAGE, kind, f"image input '{name}': {source}: {message}")


# --------------------------------------------------------------------------- one image


def canonicalise(data: bytes, source: str, name: str, *, max_side: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS) -> CanonicalImage:
    """Decode, check and canonicalise one encoded image; RowError for a hostile one."""
    from PIL import Image, UnidentifiedImageError

    try:
        # lazy: reads the header only. Pillow itself refuses more than 2 x MAX_IMAGE_PIXELS
        # (~179 M) here (DecompressionBombError)
        im = Image.open(io.BytesIO(data))
        width, height = im.size
        if width * height > max_pixels:
            raise _error(E.IMAGE_TOO_LARGE, name, source, f"{width}x{height} = {width * height} pixels, more than max_pixels ({max_pixels})")
        fmt = im.format
        im.load()
    except RowError:
        raise
    except Image.DecompressionBombError as e:
        raise _error(E.IMAGE_TOO_LARGE, name, source, f"{e}") from None
    except UnidentifiedImageError:
        raise _error(E.IMAGE_UNREADABLE, name, source, f"not an image Pillow can read ({len(data)} bytes, starting {data[:8]!r})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated, corrupt
        raise _error(E.IMAGE_UNREADABLE, name, source, f"cannot decode the image ({type(e).__name__}: {e})") from None
    try:
        im, changed = _canonical(im, max_side)
        if changed or fmt not in _PASSTHROUGH:
            buf = io.BytesIO()
            if fmt == "JPEG":  # already lossy: JPEG again (a photo as PNG costs ~10x the time and bytes)
                im.save(buf, format="JPEG", quality=95)
                mime = "image/jpeg"
            else:  # lossless; level 6 costs ~7x the time of level 1 for about the same size
                im.save(buf, format="PNG", compress_level=1)
                mime = "image/png"
            data = buf.getvalue()
        else:
            mime = _PASSTHROUGH[fmt]
    except (OSError, ValueError, SyntaxError, EOFError, KeyError) as e:  # a corrupt EXIF block, an odd mode
        raise _error(E.IMAGE_UNREADABLE, name, source, f"cannot convert the image ({type(e).__name__}: {e})") from None
    return CanonicalImage(data, mime, im.width, im.height, hashlib.sha256(data).hexdigest(), source, im)


def _canonical(im, max_side: int | None):
    """(upright RGB image within max_side, whether it differs from the decoded one)."""
    from PIL import Image, ImageOps

    changed = False
    orientation = im.getexif().get(0x0112, 1)
    if orientation not in (None, 1):
        im = ImageOps.exif_transpose(im)
        changed = True
    if im.mode != "RGB":
        if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            background = Image.new("RGB", rgba.size, (255, 255, 255))
            background.paste(rgba, mask=rgba.getchannel("A"))
            im = background
        else:
            im = im.convert("RGB")
        changed = True
    if max_side and max(im.size) > max_side:
        scale = max_side / max(im.size)
        im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.Resampling.LANCZOS)
        changed = True
    return im, changed


def _data_uri_bytes(value: str, name: str) -> bytes:
    m = _DATA_URI.match(value)
    shown = value[:40] + ("..." if len(value) > 40 else "")
    if not m:
        raise _error(E.IMAGE_UNREADABLE, name, shown, "malformed data: URI (expected data:<mime>;base64,<data>)")
    payload = value[m.end() :]
    if not m.group(3):
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"bad base64 in the data: URI ({e})") from None


def _fetch(url: str, name: str, max_bytes: int) -> bytes:
    import httpx2

    try:
        with httpx2.stream("GET", url, timeout=REMOTE_TIMEOUT_SECONDS, follow_redirects=True) as response:
            if response.status_code != 200:
                raise _error(E.IMAGE_MISSING, name, url, f"the server answered HTTP {response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise _error(E.IMAGE_TOO_LARGE, name, url, f"more than max_bytes ({max_bytes}) bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except RowError:
        raise
    except Exception as e:  # noqa: BLE001 - DNS, connection refused, timeout, TLS: the network
        raise _error(E.IMAGE_REMOTE_UNREACHABLE, name, url,
            f"cannot download it ({type(e).__name__}: {e}); no network may be reachable from this job "
            "(cluster nodes often have none): download the images beforehand and use local paths",
        ) from None  # fmt: skip


def _read_file(path: str, shown: str, name: str, max_bytes: int) -> bytes:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise _error(E.IMAGE_MISSING, name, shown, f"no such file ({path})") from None
    except OSError as e:
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"cannot read it ({e.strerror or e})") from None
    if os.path.isdir(path):
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"is a directory ({path})")
    if size > max_bytes:
        raise _error(E.IMAGE_TOO_LARGE, name, shown, f"{size} bytes, more than max_bytes ({max_bytes})")
    try:
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"cannot read it ({e.strerror or e})") from None


# --------------------------------------------------------------------------- a row's images


def dataset_image_base(ds: DatasetConfig) -> str:
    """Where relative image paths of dataset ``ds`` start: image_base_path, else its folder."""
    base = getattr(ds, "image_base_path", None)
    if base:
        return os.path.expanduser(base)
    path = ds.path
    if any(c in path for c in "*?["):  # a Parquet glob: the folder before the first wildcard
        while any(c in path for c in "*?["):
            path = os.path.dirname(path)
        return path or "."
    return path if os.path.isdir(path) else (os.path.dirname(path) or ".")


@dataclass(frozen=True)
class ImageInput:
    name: str
    max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES


class RowImages:
    """Loads a row's image inputs: ``(variables, dataset index) -> {name: [CanonicalImage]}``."""

    def __init__(self, inputs: Iterable[ImageInput], datasets: Iterable = ()):
        self.inputs = list(inputs)
        self.bases = {ds.index: dataset_image_base(ds) for ds in datasets}

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> "RowImages":
        """The image inputs of a PipelineConfig (empty, and false, when it has none)."""
        specs = [
            ImageInput(v.name, v.max_side, v.max_pixels or DEFAULT_MAX_PIXELS, v.max_bytes or DEFAULT_MAX_BYTES)
            for v in cfg.inputs
            if getattr(v, "type", "text") == "image"
        ]
        return cls(specs, cfg.datasets)

    def __bool__(self) -> bool:
        return bool(self.inputs)

    def __call__(self, variables: Mapping[str, Any], ds_index: int = 0) -> dict[str, list[CanonicalImage]]:
        base = self.bases.get(ds_index, ".")
        out = {}
        for spec in self.inputs:
            value = variables.get(spec.name)
            values = value if isinstance(value, list | tuple) else [value]
            if not values:
                raise _error(E.IMAGE_INVALID_VALUE, spec.name, "[]", "an empty list (no image)")
            out[spec.name] = [self.load(v, spec, base) for v in values]
        return out

    def load(self, value: Any, spec: ImageInput, base: str = ".") -> CanonicalImage:
        name = spec.name
        source, data = self._bytes(value, spec, base)
        if len(data) > spec.max_bytes:
            raise _error(E.IMAGE_TOO_LARGE, name, source, f"{len(data)} bytes, more than max_bytes ({spec.max_bytes})")
        return canonicalise(data, source, name, max_side=spec.max_side, max_pixels=spec.max_pixels)

    def _bytes(self, value: Any, spec: ImageInput, base: str) -> tuple[str, bytes]:
        name = spec.name
        if isinstance(value, Mapping):  # a Hugging Face Image feature: {"bytes", "path"}
            if value.get("bytes"):
                return str(value.get("path") or "image bytes"), bytes(value["bytes"])
            if value.get("path"):
                value = value["path"]
            else:
                raise _error(E.IMAGE_INVALID_VALUE, name, "{...}", f"an object without image bytes or path (keys: {sorted(value)})")
        if isinstance(value, bytes | bytearray):
            return "image bytes", bytes(value)
        if hasattr(value, "save") and hasattr(value, "size"):  # a decoded PIL image (datasets' own decoding)
            buf = io.BytesIO()
            try:
                value.save(buf, format="PNG")
            except (OSError, ValueError) as e:
                raise _error(E.IMAGE_UNREADABLE, name, "PIL image", f"cannot encode it ({e})") from None
            return "PIL image", buf.getvalue()
        if not isinstance(value, str) or not value.strip():
            raise _error(E.IMAGE_INVALID_VALUE, name, repr(value)[:60], "not an image path, data: URI, URL or image bytes")
        if value.startswith("data:"):
            return "data: URI", _data_uri_bytes(value, name)
        lower = value.lower()
        if lower.startswith(("http://", "https://")):
            return value, _fetch(value, name, spec.max_bytes)
        if lower.startswith("file://"):
            value = value[len("file://") :]
        path = os.path.join(base, os.path.expanduser(value))
        return value, _read_file(path, value, name, spec.max_bytes)


# --------------------------------------------------------------------------- messages


def marked(variables: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The variables with each image variable replaced by its marker, for rendering prompts."""
    out = dict(variables)
    for name in names:
        out[name] = f"{_MARK_OPEN}{name}{_MARK_CLOSE}"
    return out


def attach(messages: list[dict], images: Mapping[str, list[CanonicalImage]], order: Iterable[str]) -> list[CanonicalImage]:
    """Turn the rendered messages' image markers into content parts; the images in part order.

    The user turn that holds markers gets an image part per image where each marker stood;
    when no turn holds one, the last user turn gets every image (``order``: input order) at
    its start. A marker outside a user turn (a system prompt) or mangled by a filter is a
    row error. ``messages`` is changed in place.
    """
    placed: list[CanonicalImage] = []
    found = False
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or _MARK_OPEN not in content:
            continue
        if message.get("role") != "user":
            raise RowError("render", E.TEMPLATE_ERROR, f"image variables may only be used in the user prompt, not in a {message.get('role')} message")
        found = True
        parts: list[dict] = []
        pos = 0
        for m in _MARK.finditer(content):
            if m.start() > pos:
                parts.append({"type": "text", "text": content[pos : m.start()]})
            if m.group(1) not in images:
                raise RowError("render", E.TEMPLATE_ERROR, "an image variable was changed by a template filter; use it as a plain {{ name }}")
            for image in images[m.group(1)]:
                parts.append({"type": "image"})
                placed.append(image)
            pos = m.end()
        if pos < len(content):
            parts.append({"type": "text", "text": content[pos:]})
        if any(_MARK_OPEN in p.get("text", "") or _MARK_CLOSE in p.get("text", "") for p in parts):
            raise RowError("render", E.TEMPLATE_ERROR, "an image variable was changed by a template filter; use it as a plain {{ name }}")
        message["content"] = parts
    if not found:
        users = [m for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        if not users:
            raise RowError("render", E.TEMPLATE_ERROR, "the row has images but no user turn to put them in")
        ordered = [image for name in order for image in images.get(name, ())]
        users[-1]["content"] = [{"type": "image"} for _ in ordered] + [{"type": "text", "text": users[-1]["content"]}]
        placed = ordered
    return placed


def openai_messages(messages: list[dict], images: list[CanonicalImage]) -> list[dict]:
    """Messages for an OpenAI-compatible chat endpoint: each image part as
    ``{"type": "image_url", "image_url": {"url": "data:..."}}``, in order."""
    it = iter(images)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image":
                    parts.append({"type": "image_url", "image_url": {"url": next(it).data_uri()}})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out


# --------------------------------------------------------------------------- placeholders


def image_token(model_dir) -> str | None:
    """The image placeholder a model's chat template writes (``<image>``, ``<|image_pad|>``),
    read from its processor or tokenizer config; None when not declared."""
    import json
    from pathlib import Path

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        try:
            data = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        token = data.get("image_token") if isinstance(data, dict) else None
        if isinstance(token, str) and token:
            return token
    return None


def placeholder_error(prompt: str, token: str | None, count: int) -> str | None:
    """Why ``prompt`` does not hold exactly one ``token`` per image, or None."""
    if token is None:
        return None
    found = prompt.count(token)
    if found == count:
        return None
    return f"the rendered prompt holds {found} image placeholder(s) '{token}' for {count} image(s); the chat template must write one per image part"
