"""report.html in a real browser: headless Chromium renders it to a PNG (scripts/render_report.sh)
and dumps the DOM it parsed. Tests that need it skip without Chromium, unless
MIRAGEFLOW_REQUIRE_CHROMIUM=1 (.ci/run installs Chromium and sets it), where they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RENDER_SECONDS = 180  # a cold Chromium start on a loaded 2-core machine takes tens of seconds


def chromium() -> str:
    """The browser's path; skips (or fails under MIRAGEFLOW_REQUIRE_CHROMIUM=1) without one."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found:
        return found
    message = "no chromium (Debian: apt-get install chromium; .ci/run installs it as root)"
    if os.environ.get("MIRAGEFLOW_REQUIRE_CHROMIUM") == "1":
        pytest.fail(message)
    pytest.skip(message)


def screenshot(page: Path, out: Path, width: int = 1280, height: int = 3000) -> Path:
    """``page`` rendered to ``out`` (PNG) by the project's own script."""
    chromium()
    subprocess.run(["bash", str(REPO / "scripts/render_report.sh"), str(page), str(out), str(width), str(height)],
                   check=True, capture_output=True, text=True, timeout=RENDER_SECONDS)  # fmt: skip
    return out


def dom(page: Path) -> str:
    """The DOM Chromium built from ``page`` (offline, as the render script runs it)."""
    browser = chromium()
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", "--dump-dom", page.resolve().as_uri()],
            check=True, capture_output=True, text=True, timeout=RENDER_SECONDS,
        )  # fmt: skip
    return proc.stdout


def pixels(png: Path) -> tuple[tuple[int, int], dict[tuple[int, int, int], int]]:
    """(size, {RGB colour: pixel count}) of a screenshot."""
    from PIL import Image

    with Image.open(png) as im:
        rgb = im.convert("RGB")
        return rgb.size, {colour: n for n, colour in rgb.getcolors(maxcolors=rgb.size[0] * rgb.size[1])}


def near(colours: dict, target: str, tolerance: int = 12) -> int:
    """Pixels within ``tolerance`` per channel of ``target`` (#rrggbb)."""
    want = tuple(int(target[i : i + 2], 16) for i in (1, 3, 5))
    return sum(n for c, n in colours.items() if all(abs(a - b) <= tolerance for a, b in zip(c, want)))
