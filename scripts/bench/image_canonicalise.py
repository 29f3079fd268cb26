"""Cost of loading and canonicalising one image input (mirageflow.prompts.images), per image.

    python scripts/bench/image_canonicalise.py            # ~30 s
    python scripts/bench/image_canonicalise.py --repeats 50

A 1024x768 photo-like JPEG (smooth gradients plus noise, quality 90) read from disk, as a
row's image path: (1) passed through (already upright RGB JPEG: only decoded and hashed),
(2) with ``max_side: 512`` (resized with LANCZOS and re-encoded as PNG), (3) with an EXIF
orientation to undo (transposed, re-encoded as PNG). One thread; medians of ``--repeats``.
The shard runner does this off the event loop (``asyncio.to_thread``), once per row for all
outputs; for a GPU engine it must stay well below the engine's time per row.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from mirageflow.prompts import images


def photo(rotated: bool) -> bytes:
    from PIL import Image

    w, h = 1024, 768
    gradient = Image.linear_gradient("L").resize((w, h))
    noise = Image.effect_noise((w, h), 20)
    im = Image.merge("RGB", (gradient, noise, gradient.rotate(180)))
    buf = io.BytesIO()
    if rotated:
        exif = Image.Exif()
        exif[0x0112] = 6
        im.save(buf, format="JPEG", quality=90, exif=exif)
    else:
        im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "plain.jpg").write_bytes(photo(False))
        Path(tmp, "rotated.jpg").write_bytes(photo(True))
        cases = {
            "passthrough_ms": ("plain.jpg", images.ImageInput("photo")),
            "max_side_512_ms": ("plain.jpg", images.ImageInput("photo", max_side=512)),
            "exif_transpose_ms": ("rotated.jpg", images.ImageInput("photo")),
        }
        results = {}
        for name, (path, spec) in cases.items():
            loader = images.RowImages([spec])
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                loader({"photo": str(Path(tmp, path))})
                times.append((time.perf_counter() - t) * 1000)
            results[name] = statistics.median(times)
    for name, value in results.items():
        print(f"{name}: {value:.1f}")


if __name__ == "__main__":
    main()
