"""The real-engine test environments (tests/real_sglang_env.py) built from inside a
virtualenv, as the README's Quick start makes one: the new environment sees the packages of
the virtualenv that builds it, not only its base interpreter's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_sglang_env_built_inside_a_virtualenv_sees_that_virtualenvs_packages(tmp_path):
    parent = tmp_path / "quickstart-venv"  # a virtualenv of its own, without the system's packages
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(parent)], check=True)
    site = Path(
        subprocess.run(
            [str(parent / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "only_in_the_parent").mkdir()
    (site / "only_in_the_parent" / "__init__.py").write_text("WHERE = 'parent venv'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    child = tmp_path / "venv-sglang"
    build = "import sys; from pathlib import Path; import real_sglang_env as e; e.make_venv(Path(sys.argv[1]), '--without-pip')"
    subprocess.run([str(parent / "bin" / "python"), "-c", build, str(child)], check=True, env=env, cwd=REPO / "tests")
    seen = subprocess.run(
        [str(child / "bin" / "python"), "-c", "import only_in_the_parent as m; print(m.WHERE)"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert seen.returncode == 0 and seen.stdout.strip() == "parent venv", seen.stderr[-2000:]
