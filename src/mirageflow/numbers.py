"""Numbers as the state files hold them and as people read them: one definition of each.

``is_number`` is what a state file's numeric field must be (not a bool, finite);
``fmt`` is how the report and ``mmirage status`` print a figure, ``fmt_rate`` how the
terminal prints a rate, ``count`` a count with its unit ("1 row", "2,000 samples").
"""

from __future__ import annotations

import json
import math


def is_number(value) -> bool:
    """An int or float that is finite (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fmt(value) -> str:
    """A figure for a table: ``n/a`` for none, thousands separators, 3 decimals below 100, 1 above."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def fmt_rate(value: float | None) -> str:
    """A rate for a one-line status: 2 decimals below 10, 1 below 100, none above."""
    if value is None:
        return "n/a"
    return f"{value:,.2f}" if value < 10 else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def count(n: int, unit: str) -> str:
    """``n`` with its unit, plural when not 1: ``count(1, "row")`` is "1 row", ``count(2000, "sample")`` "2,000 samples"."""
    return f"{n:,} {unit}" + ("" if n == 1 else "s")


def percent(part: float, whole: float) -> str:
    """``part`` of ``whole`` as a whole percentage, never above 100 % (nor below 0)."""
    if not whole:
        return "n/a"
    return f"{max(0.0, min(100.0, 100 * part / whole)):.0f}%"


def show(value, width: int = 40) -> str:
    """A value as JSON, cut to ``width`` characters: for messages about a wrong value."""
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."
