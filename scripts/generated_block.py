"""A generated block of a Markdown file, between two marker comments: rewrite it, or check it.

Used by scripts/schema_docs.py (config/README.md's key table) and scripts/row_error_docs.py
(docs/troubleshooting.md's row error classes).
"""

from __future__ import annotations

import sys
from pathlib import Path


def replace_block(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what stands between ``begin`` and ``end`` replaced by ``body``."""
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def write_or_check(path: Path, begin: str, end: str, body: str, script: str, argv: list[str]) -> int:
    """Rewrite the block (exit status 0), or with ``--check`` in argv: 1 when it is out of date."""
    text = path.read_text()
    new = replace_block(text, begin, end, body)
    if "--check" in argv:
        if new != text:
            print(f"{path} is out of date: run python {script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0
