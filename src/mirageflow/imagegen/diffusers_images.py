"""A local diffusers pipeline in the shard process (``backend: diffusers``, EPFLiGHT
MMIRAGE's ``pipeline_args``): CPU or GPU, several prompts per call.

- Load: ``DiffusionPipeline.from_pretrained(model_path, local_files_only=True)`` (a
  diffusers directory with model_index.json, or a hub id already in the local cache: the
  jobs download nothing), ``torch_dtype`` (auto: float32 on a CPU, the checkpoint's on a
  GPU), ``device`` (auto: cuda when torch sees a GPU, else cpu), attention slicing on request.
- Generation: rows waiting for an image are grouped (same size, steps, guidance and
  negative prompt or none; seeded or not) up to ``parallel_chunk_size`` prompts (1 without
  ``parallel_inference``), and each group is one pipeline call in a worker thread, so the
  event loop that feeds the other steps goes on; each image has its own
  ``torch.Generator`` seeded with the row's seed.
- Errors: a group whose call raises is generated again one prompt at a time, so one bad
  prompt fails its row only (``image_generation_failed``); a pipeline's safety checker
  flagging an image (``nsfw_content_detected``) is ``content_filter``; CUDA out of memory
  fails the shard.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from mirageflow.config.types import ImageGenProcessor
from mirageflow.errors import RowErrorClass as E
from mirageflow.imagegen.base import ImageError, ImageGenerator, ImageJob

log = logging.getLogger(__name__)

_DTYPES = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


@dataclass
class _Waiting:
    job: ImageJob
    future: asyncio.Future


class DiffusersImages(ImageGenerator):
    backend = "diffusers"

    def __init__(self, processor: ImageGenProcessor):
        super().__init__()
        self.processor = processor
        self.chunk = (processor.parallel_chunk_size or 4) if processor.parallel_inference else 1
        self.max_inflight = max(2 * self.chunk, 4)
        self.pipeline = None
        self.device = "cpu"
        self._waiting: list[_Waiting] = []
        self._worker: asyncio.Task | None = None

    def load(self) -> None:
        try:
            import diffusers
            import torch
        except ImportError as e:
            raise RuntimeError(f"image_gen backend diffusers needs the diffusers package: pip install -r requirements.txt ({e})") from e
        p = self.processor
        device = p.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kwargs = {"local_files_only": True}
        if p.revision:
            kwargs["revision"] = p.revision
        if p.torch_dtype != "auto":
            kwargs["dtype"] = getattr(torch, _DTYPES[p.torch_dtype])
        elif device == "cpu":
            kwargs["dtype"] = torch.float32  # half precision is slow or unsupported on CPUs
        pipeline = diffusers.DiffusionPipeline.from_pretrained(p.model_path, **kwargs)
        pipeline = pipeline.to(device)
        if p.enable_attention_slicing and hasattr(pipeline, "enable_attention_slicing"):
            pipeline.enable_attention_slicing()
        if hasattr(pipeline, "set_progress_bar_config"):
            pipeline.set_progress_bar_config(disable=True)
        self.pipeline, self.device = pipeline, device
        self.info = {
            "backend": self.backend, "model_path": p.model_path, "pipeline": type(pipeline).__name__, "device": device,
            "dtype": str(getattr(pipeline, "dtype", None)), "parallel_chunk_size": self.chunk,
            "versions": {"diffusers": diffusers.__version__, "torch": torch.__version__},
        }  # fmt: skip

    async def generate(self, job: ImageJob):
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(job, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    @staticmethod
    def _group_key(job: ImageJob) -> tuple:
        return (job.width, job.height, job.negative_prompt, job.seed is None, tuple(sorted(job.params.items())))

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let the rows that are ready join the first group
        while self._waiting:
            key = self._group_key(self._waiting[0].job)
            group = [w for w in self._waiting if self._group_key(w.job) == key][: self.chunk]
            for w in group:
                self._waiting.remove(w)
            try:
                images = await asyncio.to_thread(self._call, [w.job for w in group])
            except Exception as e:  # noqa: BLE001 - isolated below
                if len(group) > 1:  # one prompt at a time: only the bad one fails
                    for w in group:
                        await self._one(w)
                    continue
                self._fail(group[0], e)
                continue
            for w, result in zip(group, images):
                if not w.future.done():
                    if isinstance(result, Exception):
                        w.future.set_exception(result)
                    else:
                        w.future.set_result(result)

    async def _one(self, w: _Waiting) -> None:
        try:
            (result,) = await asyncio.to_thread(self._call, [w.job])
        except Exception as e:  # noqa: BLE001
            self._fail(w, e)
            return
        if not w.future.done():
            w.future.set_exception(result) if isinstance(result, Exception) else w.future.set_result(result)

    @staticmethod
    def _fail(w: _Waiting, e: Exception) -> None:
        if w.future.done():
            return
        if "out of memory" in str(e).lower():
            w.future.set_exception(RuntimeError(f"the diffusers pipeline ran out of memory: {e}"))
        else:
            w.future.set_exception(ImageError(E.IMAGE_GENERATION_FAILED, f"the diffusers pipeline failed: {type(e).__name__}: {e}"))

    def _call(self, jobs: list[ImageJob]) -> list:
        """One pipeline call for jobs of one group (a worker thread): their images, or an
        ImageError per image the safety checker flagged."""
        import torch

        first = jobs[0]
        kwargs = dict(first.params)
        kwargs["prompt"] = [j.prompt for j in jobs]
        if first.negative_prompt:
            kwargs["negative_prompt"] = [first.negative_prompt] * len(jobs)
        if first.width and first.height:
            kwargs["width"], kwargs["height"] = int(first.width), int(first.height)
        if first.seed is not None:
            kwargs["generator"] = [torch.Generator(device=self.device).manual_seed(int(j.seed)) for j in jobs]
        with torch.inference_mode():
            output = self.pipeline(**kwargs)
        images = list(output.images)
        if len(images) != len(jobs):
            raise RuntimeError(f"the pipeline returned {len(images)} images for {len(jobs)} prompts")
        flagged = getattr(output, "nsfw_content_detected", None) or [False] * len(jobs)
        return [
            ImageError(E.CONTENT_FILTER, "the pipeline's safety checker flagged the image") if bad else image.convert("RGB")
            for image, bad in zip(images, flagged)
        ]

    def close(self) -> None:
        self.pipeline = None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
