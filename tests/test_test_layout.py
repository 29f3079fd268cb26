"""The tests' own layout: shared helpers live in tests/fakes/ and conftest.py, never in a test module.

No test module imports another (``from test_shard import ...`` made the importer depend on the
other file's private helpers and on its fixtures being active), no fixture is imported by name
(pytest finds conftest.py's fixtures by themselves), and no file edits ``sys.path`` (pyproject.toml's
``pythonpath`` puts tests/ and scripts/ there).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _fixtures(tree: ast.Module) -> set[str]:
    """Names of the functions decorated with ``pytest.fixture`` (bare or called)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in ("pytest.fixture", "fixture"):
                    names.add(node.name)
    return names


def offences(source: str, conftest_fixtures: set[str]) -> list[str]:
    """What in one file breaks the layout, one line each (empty when nothing does)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0].startswith("test_")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.split(".")[0]
            if top.startswith("test_"):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            elif top == "conftest":
                found += [f"line {node.lineno}: fixture {a.name} imported from conftest" for a in node.names if a.name in conftest_fixtures]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append"):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_the_checker_catches_each_kind_of_offence():
    source = (
        "import sys\nimport test_shard\nfrom test_report import make_state\n"
        "from conftest import REPO, no_proxy\nsys.path.insert(0, 'x')\n"
        "def f():\n    from test_shard import ScriptedEngine\n"
    )
    assert offences(source, {"no_proxy"}) == [
        "line 2: import test_shard",
        "line 3: from test_report import ...",
        "line 4: fixture no_proxy imported from conftest",
        "line 5: sys.path.insert",
        "line 7: from test_shard import ...",
    ]
    assert offences("from conftest import REPO, run_workflow\nfrom fakes.engines import ScriptedEngine\n", {"no_proxy"}) == []


def test_no_test_module_imports_another_or_a_fixture_or_edits_sys_path():
    fixtures = _fixtures(ast.parse((TESTS / "conftest.py").read_text()))
    assert {"no_proxy", "tiny_model"} <= fixtures  # the checker sees conftest's fixtures
    files = sorted(TESTS.glob("*.py")) + sorted((TESTS / "fakes").glob("*.py"))
    assert len(files) > 50
    found = [f"{p.relative_to(TESTS.parent)}: {o}" for p in files for o in offences(p.read_text(), fixtures)]
    assert found == [], "\n".join(found)
