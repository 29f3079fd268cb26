"""The docs point at things that exist: every relative link of README.md, config/README.md and
docs/*.md resolves from the file that holds it, every ``$MIRAGEFLOW_*`` variable the code
reads is documented, and a docstring naming a module of the package (``engines/x.py``)
names one that exists."""

from __future__ import annotations

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
    for path in [*SRC.rglob("*.py"), *(REPO / "workflow").rglob("*.smk"), REPO / "Snakefile"]:
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
