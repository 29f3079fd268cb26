"""The docs point at things that exist: every relative link of README.md, config/README.md and
docs/*.md resolves from the file that holds it, every ``$MIRAGEFLOW_*`` variable the code
reads is documented, and a docstring naming a module of the package (``engines/x.py``)
names one that exists."""

from __future__ import annotations

import os
import re

from conftest import REPO

DOCS = [REPO / "README.md", REPO / "config" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SRC = REPO / "src" / "mirageflow"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_resolve_from_their_file():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the same file
            path = target.split("#")[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert broken == []


def test_every_environment_variable_the_code_reads_is_documented():
    read = set()
    for path in [*SRC.rglob("*.py"), *(REPO / "workflow").rglob("*.smk"), REPO / "Snakefile", REPO / "workflow" / "Snakefile"]:
        read |= set(re.findall(r"\"(MIRAGEFLOW_[A-Z_]*[A-Z])\"", path.read_text()))
    text = "".join(doc.read_text() for doc in DOCS)
    assert sorted(v for v in read if v not in text) == []


def test_module_paths_named_in_docstrings_exist():
    """``engines/image_gen.py`` in a docstring after the module moved sends a reader nowhere."""
    rooms = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("_")}
    named = re.compile(r"\b(?:mirageflow/)?(" + "|".join(sorted(rooms)) + r")/([a-z_]+)\.py\b")
    missing = []
    for path in SRC.rglob("*.py"):
        for room, module in set(named.findall(path.read_text())):
            if not (SRC / room / f"{module}.py").exists():
                missing.append(f"{path.relative_to(REPO)}: {room}/{module}.py")
    assert missing == []


def test_the_index_of_tests_by_module_is_current_and_every_module_has_a_test():
    """tests/README.md lists the tests of every module (scripts/test_index.py): a new module
    without a test, a renamed test file, or an index left stale fails here."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "scripts/test_index.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_site_builds_with_every_link_and_anchor_resolved(tmp_path):
    """``mkdocs build --strict`` (mkdocs.yml, as .ci/run builds it): a link to a page or file
    that is not there, an anchor no heading makes, or a page of docs/ left out of the nav
    fails the build."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="config/"' in home and 'href="troubleshooting/"' in home  # README.md is the home page
    assert "<!-- row-errors:begin -->" in (tmp_path / "site" / "troubleshooting" / "index.html").read_text()
    assert "<!-- keys:begin -->" in (tmp_path / "site" / "config" / "index.html").read_text()


def test_a_broken_link_fails_the_site_build(tmp_path):
    """The hook that points README.md's and config/README.md's links into the site leaves a
    link to nothing as written, so the strict build names it."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "README.md", "docs", "config", "scripts", "profiles", "workflow"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, copy / name)
    readme = copy / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/no-such-page.md) [moved](docs/cli.md#no-such-section)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=copy, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.count("WARNING") == 2, proc.stderr  # those two, nothing else
    assert "no-such-page.md" in proc.stderr and "no-such-section" in proc.stderr


def test_readme_is_a_landing_page_and_each_text_has_one_copy():
    """README.md says what it is, the two commands and a first pipeline, then where to go; the
    rest lives on the site's pages, each prose line in one file only."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "snakemake --cores 1" in readme and "--profile profiles/slurm" in readme
    first_file: dict[str, str] = {}
    doubled = []
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        fenced = False
        for line in doc.read_text().splitlines():
            text = line.strip()
            fenced ^= text.startswith("```")
            if fenced or text.startswith(("```", "|", "#")) or len(text) < 60:
                continue  # code, tables and headings may repeat; prose may not
            if first_file.setdefault(text, name) != name:
                doubled.append(f"{first_file[text]} and {name}: {text[:80]}")
    assert doubled == []
