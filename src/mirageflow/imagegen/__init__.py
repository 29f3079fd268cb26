"""Image generation for ``image_gen`` outputs: where an image comes from (``processors[]``
of type image_gen, ``backend``), not what is done with it (shard/steps/image.py).

- ``external`` (http_images.ExternalImages): an OpenAI-compatible images server already
  running, ``POST {base_url}/images/generations``;
- ``sglang`` (http_images.SGLangDiffusionServer): the shard job launches SGLang's
  diffusion server (sglang 0.5.23, ``python -m sglang.multimodal_gen.runtime.launch_server``)
  on a free port and talks to it as to an external server;
- ``diffusers`` (diffusers_images.DiffusersImages): a local diffusers pipeline in the shard
  process (CPU or GPU), several prompts per call.

``make_generator`` picks one; nothing heavy (torch, diffusers) is imported before
``load()``.
"""

from __future__ import annotations

from mirageflow.config.types import ImageGenProcessor
from mirageflow.imagegen.base import ImageError, ImageGenerator, ImageJob

__all__ = ["ImageError", "ImageGenerator", "ImageJob", "make_generator"]


def make_generator(processor: ImageGenProcessor, log_dir=None) -> ImageGenerator:
    if processor.backend == "diffusers":
        from mirageflow.imagegen.diffusers_images import DiffusersImages

        return DiffusersImages(processor)
    from mirageflow.imagegen import http_images

    if processor.backend == "external":
        return http_images.ExternalImages(processor)
    return http_images.SGLangDiffusionServer(processor, log_dir)
