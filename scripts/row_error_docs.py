"""Regenerate README.md's table of row error classes from mirageflow.errors.RowErrorClass.

python scripts/row_error_docs.py          # rewrite the table
python scripts/row_error_docs.py --check  # exit 1 when the README is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's package, installed or not

from mirageflow.errors import row_error_table  # noqa: E402

README = REPO / "README.md"
BEGIN, END = "<!-- row-errors:begin -->", "<!-- row-errors:end -->"


def updated(text: str) -> str:
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{row_error_table()}\n{END}{tail}"


def main() -> int:
    text = README.read_text()
    new = updated(text)
    if "--check" in sys.argv:
        if new != text:
            print(f"{README} is out of date: run python scripts/row_error_docs.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
