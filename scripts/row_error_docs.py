"""Regenerate docs/troubleshooting.md's table of row error classes from mirageflow.errors.RowErrorClass.

python scripts/row_error_docs.py          # rewrite the table
python scripts/row_error_docs.py --check  # exit 1 when the page is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's package, installed or not

from generated_block import write_or_check  # noqa: E402  (scripts/, this script's folder)
from mirageflow.errors import row_error_table  # noqa: E402

PAGE = REPO / "docs" / "troubleshooting.md"
BEGIN, END = "<!-- row-errors:begin -->", "<!-- row-errors:end -->"


def main() -> int:
    return write_or_check(PAGE, BEGIN, END, row_error_table(), "scripts/row_error_docs.py", sys.argv)


if __name__ == "__main__":
    sys.exit(main())
