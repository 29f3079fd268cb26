"""config/examples/: each example pipeline passes `mmirage check` as a newcomer runs it (from the
checkout, nothing built yet), and README.md reads top-down: quick start, the example as it is,
where to go next; engine internals live in docs/."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_pipeline_passes_mmirage_check(example):
    path = str(example.relative_to(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", "check", "--config", path],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{path}: valid ")


def test_readme_reads_top_down_with_the_example_as_it_is():
    readme = (REPO / "README.md").read_text()
    example = (REPO / "config" / "examples" / "quiz.yaml").read_text().rstrip("\n")
    assert f"```yaml\n{example}\n```" in readme  # the file CI checks, not a copy that drifts
    headings = ["## Quick start", "## Your own pipeline", "## Where to go next"]
    assert [readme.index(h) for h in headings] == sorted(readme.index(h) for h in headings)
    first_pages = readme[: readme.index("## Where to go next")]
    engines = (REPO / "docs" / "engines.md").read_text()
    for internal in ("BOS token", "grammar backend", "engines/json_prefix.py", "reasoning_content", "image_base_path"):
        assert internal not in first_pages, internal
        assert internal in engines, internal  # moved, not lost
    pipelines = (REPO / "docs" / "pipelines.md").read_text()
    for fact in ("x x x x y y y y", "filter_not_bool", "custom_timeout", "native_n"):
        assert fact in pipelines and fact not in first_pages, fact
