"""Errors in one place (mirageflow.errors): the package's base exception, input errors for exit 2,
and the row-error classes with their deterministic flag, which the terminal, `mmirage retry`
and docs/troubleshooting.md all read."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import mirageflow
from mirageflow import cli
from mirageflow.errors import DETERMINISTIC_CLASSES, InputError, MirageflowError, RowError, RowErrorClass

REPO = Path(__file__).resolve().parents[1]
# modules that import an optional heavy package at import time
OPTIONAL = {"mirageflow.engines.sglang_engine"}


def _package_exceptions() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(mirageflow.__path__, "mirageflow."):
        if info.name in OPTIONAL:
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_every_exception_of_the_package_has_the_base_and_keeps_its_other_bases():
    # control flow, BaseExceptions on purpose (no `except Exception` of a template or user code may catch them)
    control_flow = {"_CallTimeout", "RenderTimeout", "RenderTooLarge"}
    classes = [c for c in _package_exceptions() if c.__name__ not in control_flow]
    assert len(classes) >= 24
    assert [c.__qualname__ for c in classes if not issubclass(c, MirageflowError)] == []
    by_name = {c.__name__: c for c in classes}
    assert issubclass(by_name["ConfigError"], (InputError, ValueError)) and issubclass(by_name["ConfigError"], ValueError)
    assert issubclass(by_name["PartUnreadable"], OSError) and issubclass(by_name["DatasetReadError"], OSError)
    assert issubclass(by_name["ShardFailed"], RuntimeError) and issubclass(by_name["EngineError"], RuntimeError)
    assert issubclass(by_name["OutputError"], ValueError) and issubclass(by_name["OwnershipError"], InputError)


def test_row_errors_are_classes_of_the_enum_and_json_keeps_their_names():
    e = RowError("read", "bad_row", "line 3: not JSON")
    assert e.kind is RowErrorClass.BAD_ROW and e.kind == "bad_row" and str(e) == "line 3: not JSON"
    assert json.dumps({"error": e.kind}) == '{"error": "bad_row"}'
    assert Counter({"bad_row": 1}) + Counter({e.kind: 2}) == Counter({"bad_row": 3})  # hashes as its text
    with pytest.raises(ValueError, match="'bad_raw' is not a valid RowErrorClass"):
        RowError("read", "bad_raw", "a class nobody knows")


def test_the_deterministic_classes_are_the_ones_a_retry_reproduces():
    """The set `mmirage status`/`retry` and the summary used before it moved here (no behaviour change), and
    batch_api's and image_gen's: a request larger than a batch may hold, a file name taken by another row."""
    assert DETERMINISTIC_CLASSES == {
        "template_error", "missing_variable", "extract_error", "json_schema", "chat_template", "bad_row", "context_length",
        "invalid_unicode", "reasoning_truncated", "bad_conversation", "request_too_large", "image_name_taken",
        # issue 22: a render past its limits, an image path outside image_base_path (the same config and data)
        "template_timeout", "template_too_large", "image_outside_base",
        # issue 33: a file name the filesystem refuses (the same template and row give the same name)
        "image_name_refused",
    }  # fmt: skip
    from mirageflow.report.terminal import repeats_identically

    assert repeats_identically({"rows_failed_by_class": {"reasoning_truncated": 2}}) == "reasoning_truncated"
    assert repeats_identically({"rows_failed_by_class": {"aborted": 2}}) is None


def test_the_docs_list_every_row_error_class_as_the_enum_says():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "row_error_docs.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    for c in RowErrorClass:
        assert f"| `{c.value}` | {c.stage} | {'fails the same way' if c.deterministic else 'may succeed'} |" in page


def test_docs_list_every_engine_death_class_as_the_enum_says():
    from mirageflow.errors import EngineDeathClass

    assert [c.value for c in EngineDeathClass] == [
        "out_of_memory", "killed_by_signal", "exited_with_error", "frozen", "failed_to_start", "engine_service_died", "device_error",
        "budget_exceeded",
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "row_error_docs.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    engines = (REPO / "docs" / "engines.md").read_text()
    for c in EngineDeathClass:
        assert f"| `{c.value}` | {c.meaning} |" in engines


def test_the_cli_maps_only_our_input_errors_to_exit_2(monkeypatch, capsys):
    def bad_input(args):
        raise cli.UsageError("state_dir /x does not exist")

    monkeypatch.setattr(cli, "cmd_status", bad_input)
    assert cli.main(["status", "--config", "p.yaml"]) == cli.EXIT_USAGE
    assert "mmirage status: state_dir /x does not exist" in capsys.readouterr().err

    def bug(args):
        raise ValueError("a bug of ours, or of a library")

    monkeypatch.setattr(cli, "cmd_status", bug)
    with pytest.raises(ValueError, match="a bug of ours"):  # a traceback, not "usage or config error"
        cli.main(["status", "--config", "p.yaml"])


def test_a_completions_and_an_image_errors_class_is_the_enum_and_a_misspelt_one_raises_where_it_is_made():
    """Row error classes travel as RowErrorClass from the engine to errors.jsonl: a name given
    as text becomes the member, and a typo raises at the Completion or ImageError, not later."""
    from mirageflow.engines.wire import Completion
    from mirageflow.imagegen.base import ImageError

    completion = Completion(3, "", 0, 0, "abort", "context_length", "too long")
    assert completion.error_kind is RowErrorClass.CONTEXT_LENGTH and json.dumps(completion.error_kind) == '"context_length"'
    assert Completion(3, "ok", 1, 1, "stop").error_kind is None
    assert ImageError("image_undecodable", "no image").kind is RowErrorClass.IMAGE_UNDECODABLE
    with pytest.raises(ValueError, match="'context_lenght' is not a valid RowErrorClass"):
        Completion(3, "", 0, 0, "abort", "context_lenght", "too long")
    with pytest.raises(ValueError, match="'image_undecodeable' is not a valid RowErrorClass"):
        ImageError("image_undecodeable", "no image")


def test_row_error_classes_are_named_by_the_enum_where_they_are_made():
    """A row-error class written as a string literal fails only when that row fails, at run
    time; as ``RowErrorClass.X`` a typo fails at import. No module of the package spells one
    as a literal where a row error is made (issue 35, item 3)."""
    import ast
    from pathlib import Path

    import mirageflow
    from mirageflow.errors import RowErrorClass

    makers = {"ImageError": 0, "RowError": 1, "_failed": 1, "Completion": 5}  # the kind's position
    literal = []
    for path in sorted(Path(mirageflow.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            spots = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in makers and len(node.args) > makers[name]:
                    spots.append(node.args[makers[name]])
                spots += [k.value for k in node.keywords if k.arg == "error_kind"]
            elif isinstance(node, ast.Assign) and any(getattr(t, "attr", None) == "error_kind" for t in node.targets):
                spots.append(node.value)
            while spots:
                spot = spots.pop()
                if isinstance(spot, ast.IfExp):  # kind = A if ... else B
                    spots += [spot.body, spot.orelse]
                elif isinstance(spot, ast.Constant) and isinstance(spot.value, str):
                    literal.append(f"{path.name}:{spot.lineno}: {spot.value!r}")
    assert not literal, "row-error classes as string literals (use RowErrorClass.X):\n" + "\n".join(literal)
    assert len(RowErrorClass) > 20  # the walk saw the classes it guards
