"""Image inputs for vision-language models: each row's image values loaded, checked and
canonicalised once, then placed into the chat messages where the prompt puts them.

An image input (``processing_params.inputs[].type: image``) holds, per row, one image
source or a list of them (several images per row):

- a path, relative to ``datasets[].image_base_path`` or, without it, to the dataset's
  folder (the JSONL/Parquet file's directory, the ``save_to_disk`` directory). It must stay
  inside that folder once ``..`` and symbolic links are resolved (an absolute path too),
  else the row error ``image_outside_base``, unless the dataset sets
  ``allow_images_outside_base: true``: a dataset row must not make the workflow read any
  image on the node and send it to a (remote) endpoint. Only a regular file is read (a
  FIFO or a device is refused before it is opened: reading a FIFO can wait forever);
- a Hugging Face ``Image`` feature value (Parquet, ``save_to_disk``): ``{"bytes", "path"}``,
  bytes first;
- a ``data:`` URI (``data:image/png;base64,...``);
- an ``http(s)://`` URL, fetched within ``REMOTE_DEADLINE_SECONDS`` in all (connection,
  redirects and every byte: a server that trickles its answer is cut at the deadline, not
  only one that stops) and at most ``max_bytes`` bytes (a job without network gets the row
  error ``image_remote_unreachable``, which says so).

Error messages never quote the bytes of what was read (a path can name any file: its
first bytes could be a password file's).

Canonical form (``CanonicalImage``): EXIF orientation applied, RGB (alpha composited on
white), the longest side at most ``max_side`` when set; the source bytes are kept when
nothing had to change (a plain RGB JPEG or PNG), else the result is re-encoded: as JPEG
(quality 95) when the source was a JPEG, else as PNG.
``sha256`` is that of the bytes the model receives.

Hostile values are row errors (stage ``image``) naming the input and the source:
``image_missing`` (no such file), ``image_unreadable`` (not an image, truncated, a
directory, a FIFO, bad base64), ``image_too_large`` (more than ``max_bytes`` bytes or
``max_pixels`` pixels, checked before decoding: a decompression bomb is never decoded),
``image_remote_unreachable`` (no answer, or not within the deadline), ``image_outside_base``
(a path outside image_base_path) and ``image_invalid_value`` (a number, an empty list, a
path with a NUL byte, an Image feature whose ``bytes`` are text...).

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
import functools
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from mirageflow.config.types import DatasetConfig, PipelineConfig
from mirageflow.files import NotRegularFile, open_regular
from mirageflow.errors import RowError, RowErrorClass as E

STAGE = "image"
DEFAULT_MAX_PIXELS = 36_000_000  # 6000 x 6000; Pillow's own bomb check starts at ~89 M
DEFAULT_MAX_BYTES = 20 << 20  # MMIRAGE's cap on remote images
REMOTE_DEADLINE_SECONDS = 30.0  # one remote image, all included (connection, redirects, every byte)
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


_BYTES_LITERAL = re.compile(r"""b(['"]).*?(?<!\\)\1""")


def _scrub(message: str) -> str:
    """A library's message without any ``b'...'`` literal (the bytes it read), at most 300 characters."""
    return _BYTES_LITERAL.sub("b'...'", str(message))[:300]


# --------------------------------------------------------------------------- one image


def canonicalise(
    data: bytes, source: str, name: str, *, max_side: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> CanonicalImage:
    """Decode, check and canonicalise one encoded image; RowError for a hostile one."""
    from PIL import Image, UnidentifiedImageError

    try:
        # lazy: reads the header only. Pillow itself refuses more than 2 x MAX_IMAGE_PIXELS
        # (~179 M) here (DecompressionBombError)
        im = Image.open(io.BytesIO(data))
        width, height = im.size
        if width * height > max_pixels:
            raise _error(
                E.IMAGE_TOO_LARGE, name, source, f"{width}x{height} = {width * height} pixels, more than max_pixels ({max_pixels})"
            )
        fmt = im.format
        im.load()
    except RowError:
        raise
    except Image.DecompressionBombError as e:
        raise _error(E.IMAGE_TOO_LARGE, name, source, _scrub(e)) from None
    except UnidentifiedImageError:
        # never the bytes themselves: the file could be anything readable on the node
        raise _error(
            E.IMAGE_UNREADABLE, name, source, f"not an image Pillow can read ({len(data)} bytes in no image format it knows)"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated, corrupt
        raise _error(E.IMAGE_UNREADABLE, name, source, f"cannot decode the image ({type(e).__name__}: {_scrub(e)})") from None
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
        raise _error(E.IMAGE_UNREADABLE, name, source, f"cannot convert the image ({type(e).__name__}: {_scrub(e)})") from None
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
    shown = f"data:{m.group(1) or ''} URI ({len(value)} characters)" if m else f"data: URI ({len(value)} characters)"
    if not m:
        raise _error(E.IMAGE_UNREADABLE, name, shown, "malformed data: URI (expected data:<mime>;base64,<data>)")
    payload = value[m.end() :]
    if not m.group(3):
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"bad base64 in the data: URI ({_scrub(e)})") from None


def _fetch(url: str, name: str, max_bytes: int, deadline_seconds: float | None = None) -> bytes:
    """The body of ``url`` through the transport (transport/fetch.py: no credentials, redirects
    followed), within a total deadline however the server trickles its answer, at most
    ``max_bytes`` bytes. It runs in a thread of its own: the caller may be inside an event loop."""
    from mirageflow.transport.fetch import get_url_blocking
    from mirageflow.transport.http_client import DeadlineExceeded, ResponseTooLarge, TransportError

    deadline_seconds = REMOTE_DEADLINE_SECONDS if deadline_seconds is None else deadline_seconds
    try:
        response = _fetch_pool().submit(get_url_blocking, url, timeout=deadline_seconds, max_bytes=max_bytes).result()
    except ResponseTooLarge as e:
        raise _error(E.IMAGE_TOO_LARGE, name, url, f"more than max_bytes ({max_bytes}) bytes: {_scrub(e)}") from None
    except DeadlineExceeded:
        raise _error(
            E.IMAGE_REMOTE_UNREACHABLE, name, url,
            f"the download did not finish within {deadline_seconds:g} s (the deadline for one remote image)",
        ) from None  # fmt: skip
    except (TransportError, ValueError) as e:  # DNS, connection refused, TLS, a proxy: the network
        raise _error(
            E.IMAGE_REMOTE_UNREACHABLE, name, url,
            f"cannot download it ({type(e).__name__}: {_scrub(e)}); no network may be reachable from this job "
            "(cluster nodes often have none): download the images beforehand and use local paths",
        ) from None  # fmt: skip
    if response.status_code != 200:
        raise _error(E.IMAGE_MISSING, name, url, f"the server answered HTTP {response.status_code}")
    return response.content


@functools.cache
def _fetch_pool():
    import concurrent.futures

    return concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="image-fetch")


def _read_file(path: str, shown: str, name: str, max_bytes: int) -> tuple[bytes, list[int]]:
    """A regular file's bytes and stat identity (a FIFO or device is refused before it is opened)."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise _error(E.IMAGE_MISSING, name, shown, f"no such file ({path})") from None
    except NotRegularFile as e:
        kind = str(e).rsplit(" is ", 1)[-1]
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"is {kind}") from None
    except (OSError, ValueError) as e:
        raise _error(E.IMAGE_UNREADABLE, name, shown, f"cannot read it ({getattr(e, 'strerror', None) or _scrub(e)})") from None
    with f:
        try:
            st = os.fstat(f.fileno())
            if st.st_size > max_bytes:
                raise _error(E.IMAGE_TOO_LARGE, name, shown, f"{st.st_size} bytes, more than max_bytes ({max_bytes})")
            # the stat identity of what was read: a later edit of the file reruns the shard (state/inputs.py)
            return f.read(max_bytes + 1), [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        except OSError as e:
            raise _error(E.IMAGE_UNREADABLE, name, shown, f"cannot read it ({e.strerror or _scrub(e)})") from None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# --------------------------------------------------------------------------- a row's images


def dataset_image_base(ds: DatasetConfig) -> str:
    """Where relative image paths of dataset ``ds`` start: image_base_path, else its folder."""
    base = ds.image_base_path
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
        datasets = list(datasets)
        self.bases = {ds.index: dataset_image_base(ds) for ds in datasets}
        # where a path must stay (real paths), None where the dataset allows any
        self.roots = {ds.index: None if ds.allow_images_outside_base else os.path.realpath(self.bases[ds.index]) for ds in datasets}
        # called with (real path, stat identity, bytes) of every image file read (state.inputs.ImageRecorder)
        self.recorder = None

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> "RowImages":
        """The image inputs of a PipelineConfig (empty, and false, when it has none)."""
        specs = [
            ImageInput(v.name, v.max_side, v.max_pixels or DEFAULT_MAX_PIXELS, v.max_bytes or DEFAULT_MAX_BYTES)
            for v in cfg.inputs
            if v.type == "image"
        ]
        return cls(specs, cfg.datasets)

    def __bool__(self) -> bool:
        return bool(self.inputs)

    def __call__(self, variables: Mapping[str, Any], ds_index: int = 0) -> dict[str, list[CanonicalImage]]:
        base = self.bases.get(ds_index, ".")
        # built without datasets (a test, a tool): paths as given; a known dataset: confined
        root = self.roots.get(ds_index, os.path.realpath(base) if self.roots else None)
        out = {}
        for spec in self.inputs:
            value = variables.get(spec.name)
            values = value if isinstance(value, list | tuple) else [value]
            if not values:
                raise _error(E.IMAGE_INVALID_VALUE, spec.name, "[]", "an empty list (no image)")
            out[spec.name] = [self.load(v, spec, base, root) for v in values]
        return out

    def load(self, value: Any, spec: ImageInput, base: str = ".", root: str | None = None) -> CanonicalImage:
        """``root``: the real path image paths must stay in (None: anywhere)."""
        name = spec.name
        source, data = self._bytes(value, spec, base, root)
        if len(data) > spec.max_bytes:
            raise _error(E.IMAGE_TOO_LARGE, name, source, f"{len(data)} bytes, more than max_bytes ({spec.max_bytes})")
        return canonicalise(data, source, name, max_side=spec.max_side, max_pixels=spec.max_pixels)

    def _bytes(self, value: Any, spec: ImageInput, base: str, root: str | None = None) -> tuple[str, bytes]:
        name = spec.name
        if isinstance(value, Mapping):  # a Hugging Face Image feature: {"bytes", "path"}
            raw = value.get("bytes")
            if raw:
                if not isinstance(raw, bytes | bytearray | memoryview):
                    raise _error(
                        E.IMAGE_INVALID_VALUE, name, "{bytes, path}",
                        f"'bytes' is a {type(raw).__name__}, not bytes (a Hugging Face Image feature holds the encoded file)",
                    )  # fmt: skip
                return str(value.get("path") or "image bytes")[:200], bytes(raw)
            if value.get("path"):
                value = value["path"]
            else:
                raise _error(
                    E.IMAGE_INVALID_VALUE, name, "{...}", f"an object without image bytes or path (keys: {sorted(map(str, value))[:10]})"
                )
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
        if "\0" in value:
            raise _error(E.IMAGE_INVALID_VALUE, name, repr(value)[:60], "the path holds a NUL byte (no file can have that name)")
        path = os.path.join(base, os.path.expanduser(value))
        real = os.path.realpath(path)
        if root is not None and not _inside(real, root):
            raise _error(
                E.IMAGE_OUTSIDE_BASE, name, value,
                f"the path leads outside the dataset's image folder ({base}); image paths must stay inside "
                "image_base_path (set loading_params.datasets[].allow_images_outside_base: true to allow any path)",
            )  # fmt: skip
        data, key = _read_file(real, value, name, spec.max_bytes)
        if self.recorder is not None:
            self.recorder(real, key, data)
        return value, data


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
            raise RowError(
                "render", E.TEMPLATE_ERROR, f"image variables may only be used in the user prompt, not in a {message.get('role')} message"
            )
        found = True
        parts: list[dict] = []
        pos = 0
        for m in _MARK.finditer(content):
            if m.start() > pos:
                parts.append({"type": "text", "text": content[pos : m.start()]})
            if m.group(1) not in images:
                raise RowError(
                    "render", E.TEMPLATE_ERROR, "an image variable was changed by a template filter; use it as a plain {{ name }}"
                )
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
