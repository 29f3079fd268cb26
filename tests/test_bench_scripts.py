"""The benchmarks under scripts/bench/ start, and name only what exists in the code they measure.

No test runs a benchmark (minutes each), so a refactor that renames or moves what a benchmark
imports or patches (``ShardRunner._finished``, gone when the feeding moved to ``RowFeeder``)
went unseen until the benchmark was next run. This reads each script's source and checks every
project name it uses: each ``from X import Y`` and each dotted name read or assigned through
such an import (``shard.ShardRunner._finished``), also inside functions (most benchmarks import
lazily). A name of mirageflow or of tests/ (``fakes``, ``slurm_cluster``) is imported and
followed through modules and classes; a name of a sibling benchmark (``_common``,
``pipeline_overhead``) is looked up among that file's top-level names (importing it would run
its imports of optional packages). Third-party names are not checked: their packages may be
absent here (sglang, MMIRAGE's venv). And each script (not the ``_`` helpers) answers ``--help``:
its top-level imports and its argument parser work.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench"
TESTS = REPO / "tests"

# (script, dotted name) -> why a name that does not exist in this src/ is right there
NOT_HERE = {
    (
        "dedup_scale.py",
        "mirageflow.data.dedup.dedup_dataset",
    ): "--compare-src's job imports the single-job dedup from the old src/ it names",
}


def top_level_names(path: Path) -> set[str]:
    """The names a module file binds at its top level (under ``if``/``try`` too)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


class _Uses(ast.NodeVisitor):
    """The project names a source uses: (line, module, dotted attributes), in scope order."""

    def __init__(self):
        self.scopes: list[dict[str, tuple[str, list[str]]]] = [{}]  # local name -> (module, attributes)
        self.uses: list[tuple[int, str, list[str]]] = []

    def _function(self, node) -> None:
        self.scopes.append(dict(self.scopes[-1]))
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                self.scopes[-1][a.asname] = (a.name, [])
            else:  # ``import a.b`` binds ``a``; ``a.b.c`` is then read through it
                self.scopes[-1][a.name.split(".")[0]] = (a.name.split(".")[0], [])
                self.uses.append((node.lineno, a.name.split(".")[0], a.name.split(".")[1:]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        for a in node.names:
            if a.name == "*":
                continue
            self.scopes[-1][a.asname or a.name] = (node.module, [a.name])
            self.uses.append((node.lineno, node.module, [a.name]))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attrs, root = [], node
        while isinstance(root, ast.Attribute):
            attrs.insert(0, root.attr)
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.scopes[-1]:
            module, first = self.scopes[-1][root.id]
            self.uses.append((node.lineno, module, first + attrs))
        else:
            self.generic_visit(node)


def _missing_in_project(module: str, attrs: list[str]) -> str | None:
    """The first of ``module``'s dotted ``attrs`` that does not exist, followed while the value
    is a module or a class (an instance's attributes are not known without making one)."""
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        return f"module {module} cannot be imported: {e}"
    where = module
    for attr in attrs:
        if not (inspect.ismodule(obj) or inspect.isclass(obj)):
            return None
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif hasattr(obj, "__path__") and importlib.util.find_spec(f"{obj.__name__}.{attr}") is not None:  # a package's submodule
            obj = importlib.import_module(f"{obj.__name__}.{attr}")
        else:
            return f"{where} has no {attr}"
        where = f"{where}.{attr}"
    return None


def offences(source: str, bench: Path = BENCH) -> list[str]:
    """The project names ``source`` (a script of ``bench``) uses that do not exist, one line each."""
    visitor = _Uses()
    visitor.visit(ast.parse(source))
    found, sibling_names = [], {}
    for line, module, attrs in visitor.uses:
        top = module.split(".")[0]
        if (bench / f"{top}.py").exists():
            if module != top or not attrs:
                continue
            if top not in sibling_names:
                sibling_names[top] = top_level_names(bench / f"{top}.py")
            missing = None if attrs[0] in sibling_names[top] else f"scripts/bench/{top}.py defines no {attrs[0]}"
        elif top == "mirageflow" or (TESTS / f"{top}.py").exists() or (TESTS / top / "__init__.py").exists():
            missing = _missing_in_project(module, attrs)
        else:
            continue  # third-party
        if missing:
            found.append(f"line {line}: {'.'.join([module, *attrs])}: {missing}")
    return found


def test_the_checker_catches_a_gone_name_where_a_benchmark_imports_or_patches_it(tmp_path):
    (tmp_path / "_helpers.py").write_text("import os\nROOT = 1\nif os.sep:\n    def shown():\n        pass\n")
    source = (
        "import _helpers as H\n"
        "from mirageflow.shard.runner import ShardRunnr\n"
        "def child():\n"
        "    from mirageflow.shard import runner as shard\n"
        "    original = shard.ShardRunner._finished\n"
        "    shard.ShardRunner._finished = original\n"
        "    H.ROOT, H.shown(), H.gone\n"
        "    import mirageflow.shard.nothing_here\n"
        "def other():\n"
        "    shard.anything  # not bound in this function: not checked\n"
    )
    assert offences(source, tmp_path) == [
        "line 2: mirageflow.shard.runner.ShardRunnr: mirageflow.shard.runner has no ShardRunnr",
        "line 5: mirageflow.shard.runner.ShardRunner._finished: mirageflow.shard.runner.ShardRunner has no _finished",
        "line 6: mirageflow.shard.runner.ShardRunner._finished: mirageflow.shard.runner.ShardRunner has no _finished",
        "line 7: _helpers.gone: scripts/bench/_helpers.py defines no gone",
        "line 8: mirageflow.shard.nothing_here: mirageflow.shard has no nothing_here",
    ]


def test_the_checker_passes_what_exists_and_leaves_third_party_names_alone(tmp_path):
    source = (
        "import yaml\nfrom mmirage.shard_utils import _count_rows\n"
        "from mirageflow.shard import row_feeder\nfrom fakes.configs import pipeline_config\n"
        "row_feeder.RowFeeder.finished = row_feeder.RowFeeder.finished\n"
        "yaml.not_checked\n"
        "def f(engine):\n    from mirageflow.engines import transformers_generate as tg\n    tg.__name__.upper\n"
    )
    assert offences(source, tmp_path) == []


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_each_benchmark_names_only_what_exists(script):
    found = offences((BENCH / script).read_text())
    allowed = {name for s, name in NOT_HERE if s == script}
    assert [f for f in found if f.split(": ")[1] not in allowed] == []
    # an entry of NOT_HERE that the script no longer uses, or that exists now, is stale
    assert sorted(allowed) == sorted({f.split(": ")[1] for f in found} & allowed)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("[!_]*.py")))
def test_each_benchmark_starts(script):
    """Its top-level imports and its arguments: ``--help`` answers (a third of a second each)."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
