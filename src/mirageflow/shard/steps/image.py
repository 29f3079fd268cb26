"""``outputs[]`` of type image_gen: one image per row (or sample), written to a file.

``ImageStep.run(variables, unit)`` renders the prompt (and negative prompt), the row's seed
and its file name, asks the image_gen processor's generator (mirageflow.imagegen) for the
image and writes it; the variable ``<name>`` is then the file's path relative to the
dataset's output_dir, ``<name>_seed`` its seed (null without ``seed``) and ``<name>_path``
the path again; every record gets ``<name>_path`` and ``<name>_seed``.

- **Where**: ``processors[].output_dir`` (default ``<output_dir>/images`` of the row's
  dataset) / the rendered ``filename_template`` (characters other than letters, digits,
  ``.``, ``_``, ``-`` become ``_``) + ``.<file_format>``.
- **Seed**: ``samples.sample_seed(seed, dataset, source_index, sample)``: the same on every
  rerun and for any num_shards (MMIRAGE's ``seed + shard_id * 1e9 + sample_index`` changes
  with the sharding).
- **Atomic, never replacing, recorded**: the image is encoded and written to a temp file
  (fsynced), its line (path, bytes, SHA-256, seed) appended to the shard's
  ``images.jsonl`` (shard/ledger.py), then it is hard-linked into place only if no file has
  that name: a name already taken (another row's image, another pipeline's file) is the
  row error ``image_name_taken``, never a replaced file.
- **Resume and edits**: each ledger line holds the SHA-256 of the image's request (prompt,
  negative prompt, size, seed, parameters, the processor's backend and model: ``request_id``).
  A row whose image the ledger lists with the same request, and whose file still has that
  size and SHA-256, reuses it instead of generating it again (a killed shard's images are
  not paid for twice, nor an edit's unchanged rows); a row whose request changed (an edit,
  or its undo) gets a new image in place of its own old one; a file the ledger does not
  list for that row is never replaced.
- **Row errors**: ``content_filter``, ``image_timeout``, ``image_undecodable``,
  ``image_too_large``, ``image_generation_failed`` (imagegen/base.py ``ImageError``: any
  exception decoding an answer is one of these), ``image_name_taken``, ``image_name_refused``
  (a file name the filesystem refuses: longer than ``NAME_MAX`` bytes, ...),
  ``template_error``; a generator that cannot go on (its server gone, a wrong key) fails
  the shard.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mirageflow.config.types import ImageGenProcessor, OutputVar
from mirageflow.files import atomic_write_bytes
from mirageflow.imagegen.base import ImageError, ImageGenerator, ImageJob
from mirageflow.shard import samples
from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.prompts.templates import Template
from mirageflow.shard.failures import ShardFailed
from mirageflow.shard.ledger import ImageLedger, image_matches
from mirageflow.shard.steps.base import Step, Unit
from mirageflow.state.layout import image_relative, images_dir

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "webp": "WEBP"}
NAME_MAX = 255  # bytes of one file name on Linux's filesystems (ext4, xfs, btrfs, tmpfs, Lustre, GPFS)
# what the filesystem answers for a name it refuses: the row's error, not the shard's
_NAME_ERRNOS = {errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ}


@dataclass
class ShardImages:
    """What every image step of a shard shares: its id, where each dataset's rows start in
    its work, the datasets' output_dirs, n_samples and the image ledger."""

    shard_id: int
    starts: dict[int, tuple[int, int]]  # dataset -> (its first source index, units of the datasets before it)
    out_dirs: dict[int, Path]
    samples: int
    ledger: ImageLedger

    def sample_index(self, unit: Unit) -> int:
        """MMIRAGE's ``__sample_index``: the unit's position in this shard's work."""
        first, before = self.starts[unit.dataset]
        return before + (unit.source_index - first) * self.samples + unit.sample


def safe_name(text: str) -> str:
    return _UNSAFE.sub("_", text).strip("._") or "image"


def source_hash(variables: dict, inputs: list[str]) -> str:
    """MMIRAGE's ``__source_hash``: 8 hex digits of the SHA-256 of the row's input values."""
    values = {name: variables.get(name) for name in sorted(inputs)}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str, ensure_ascii=False).encode()).hexdigest()[:8]


def encode(image, file_format: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=_FORMATS[file_format])
    return buf.getvalue()


class ImageStep(Step):
    """``outputs[]`` of type image_gen: ``run`` writes the row's image and sets its variables."""

    def __init__(self, output: OutputVar, processor: ImageGenProcessor, generator: ImageGenerator, shard: ShardImages, inputs: list[str]):
        self.output, self.processor, self.generator, self.shard, self.inputs = output, processor, generator, shard, inputs
        spec = output.image
        where = f"output '{output.name}'"
        self.prompt = Template(output.prompt, f"{where} prompt")
        self.negative = Template(spec.negative_prompt, f"{where} negative_prompt") if spec.negative_prompt else None
        self.filename = Template(spec.filename_template, f"{where} filename_template")
        params = dict(processor.default_params)
        self.default_negative = params.pop("negative_prompt", None)
        self.width = spec.width or params.pop("width", None)
        self.height = spec.height or params.pop("height", None)
        params.pop("width", None), params.pop("height", None)
        for key in ("guidance_scale", "num_inference_steps"):
            if getattr(spec, key) is not None:
                params[key] = getattr(spec, key)
        self.params = params
        self.extension = processor.file_format
        self.names = (output.name, f"{output.name}_seed", f"{output.name}_path")

    def _root(self, dataset: int) -> Path:
        return Path(self.processor.output_dir) if self.processor.output_dir else images_dir(self.shard.out_dirs[dataset])

    def request_id(self, job: ImageJob) -> str:
        """The SHA-256 of what determines a row's image: the job and the processor that makes it."""
        what = {
            "job": [job.prompt, job.negative_prompt, job.width, job.height, job.seed, job.params],
            "processor": [self.processor.backend, self.processor.request_model, self.processor.model_path, self.processor.revision],
            "format": self.extension,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str, ensure_ascii=False).encode()).hexdigest()

    async def run(self, variables: dict, unit: Unit) -> bool:
        name, seed_name, path_name = self.names
        prompt = self.prompt.render(variables)
        negative = self.negative.render(variables) if self.negative else self.default_negative
        base = self.output.image.seed
        seed = (
            samples.sample_seed(base, unit.dataset, unit.source_index, unit.sample) if base is not None or self.shard.samples > 1 else None
        )
        context = {
            **variables, "__shard_id": self.shard.shard_id, "__sample_index": self.shard.sample_index(unit),
            "__source_index": unit.source_index, "__dataset": unit.dataset, "__output_name": name,
            "__source_hash": source_hash(variables, self.inputs),
        }  # fmt: skip
        file_name = f"{safe_name(self.filename.render(context))}.{self.extension}"
        if len(file_name.encode()) > NAME_MAX:
            raise RowError("output", E.IMAGE_NAME_REFUSED, f"output '{name}': the file name filename_template gives is "
                           f"{len(file_name.encode())} bytes, more than a filesystem takes ({NAME_MAX}): {file_name[:80]}...")  # fmt: skip
        out_dir = self.shard.out_dirs[unit.dataset]
        target = self._root(unit.dataset) / file_name
        relative = image_relative(out_dir, target)
        unit_key = self.shard.sample_index(unit)
        job = ImageJob(prompt, negative, self.width, self.height, seed, dict(self.params))
        request = self.request_id(job)
        entry = self.shard.ledger.get(name, unit.dataset, unit_key)
        own = entry is not None and entry.get("path") == relative and await asyncio.to_thread(image_matches, target, entry)
        if own and entry.get("request") == request:
            variables[name], variables[seed_name], variables[path_name] = relative, entry.get("seed"), relative
            return True  # written by an earlier attempt for this very request and intact: reused
        if not own and os.path.lexists(target):
            raise RowError("output", E.IMAGE_NAME_TAKEN, f"output '{name}': {target} exists and is not this row's image; "
                           "an existing file is never replaced (a filename_template that gives two rows one name?)")  # fmt: skip
        try:
            image = await self.generator.generate(job)
        except ImageError as e:
            raise RowError("generate", e.kind, f"output '{name}': {e}") from None
        except Exception as e:
            raise ShardFailed(f"image_gen ({self.processor.backend}) failed on row {unit.source_index}: {type(e).__name__}: {e}") from e
        data = await asyncio.to_thread(encode, image, self.extension)
        line = {
            "output": name, "dataset": unit.dataset, "unit": unit_key, "source_index": unit.source_index, "sample": unit.sample,
            "path": relative, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "seed": seed, "request": request,
        }  # fmt: skip
        await asyncio.to_thread(self.shard.ledger.add, line)
        try:
            # this row's own older image (its request changed) is replaced; any other file never
            written = await asyncio.to_thread(atomic_write_bytes, target, data, True, not own)
        except OSError as e:
            if e.errno in _NAME_ERRNOS:
                raise RowError("output", E.IMAGE_NAME_REFUSED, f"output '{name}': the filesystem refuses the name {target} "
                               f"({os.strerror(e.errno)})") from None  # fmt: skip
            raise
        if not written:
            raise RowError("output", E.IMAGE_NAME_TAKEN, f"output '{name}': {target} was written by another row or job meanwhile; "
                           "an existing file is never replaced")  # fmt: skip
        variables[name], variables[seed_name], variables[path_name] = relative, seed, relative
        return True
