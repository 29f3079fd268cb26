"""The workflow stays lint-clean and formatted, and the config reference matches the schema."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO


def test_snakemake_lint_is_clean():
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("snakefmt") is None, reason="snakefmt is not installed")
def test_snakefmt_check():
    proc = subprocess.run(["snakefmt", "--check", "Snakefile", "workflow"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_config_reference_is_up_to_date():
    proc = subprocess.run([sys.executable, "scripts/schema_docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
