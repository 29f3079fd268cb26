"""Regenerate docs/troubleshooting.md's table of row error classes from mirageflow.errors.RowErrorClass,
and docs/engines.md's table of engine death classes from mirageflow.errors.EngineDeathClass.

python scripts/row_error_docs.py          # rewrite the tables
python scripts/row_error_docs.py --check  # exit 1 when one is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's package, installed or not

from generated_block import write_or_check  # noqa: E402  (scripts/, this script's folder)
from mirageflow.errors import death_class_table, row_error_table  # noqa: E402

PAGE = REPO / "docs" / "troubleshooting.md"
BEGIN, END = "<!-- row-errors:begin -->", "<!-- row-errors:end -->"
ENGINES = REPO / "docs" / "engines.md"
DEATHS_BEGIN, DEATHS_END = "<!-- death-classes:begin -->", "<!-- death-classes:end -->"


def main() -> int:
    rows = write_or_check(PAGE, BEGIN, END, row_error_table(), "scripts/row_error_docs.py", sys.argv)
    deaths = write_or_check(ENGINES, DEATHS_BEGIN, DEATHS_END, death_class_table(), "scripts/row_error_docs.py", sys.argv)
    return rows or deaths


if __name__ == "__main__":
    sys.exit(main())
