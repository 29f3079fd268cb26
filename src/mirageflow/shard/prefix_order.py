"""Prefix-aware feeding: rows whose prompts share a long prefix (a system prompt, a shared
document, few-shot examples) reach the engine one after another, so its prefix cache (vLLM's
automatic prefix caching, SGLang's radix cache) computes the shared part once and reuses it
while it is still cached, instead of recomputing it for rows scattered over the shard.

The order key of a unit of work (a row, or a row's pending samples) is its first LLM
output's chat messages (roles and contents), rendered as for the request; sorting by it puts
prompts with long common prefixes next to each other (their common prefix decides their
order). ``shard_params.prefix_order``:

- ``window`` (default): the pending units are read in blocks of ``block`` (a few in-flight
  windows) and each block is fed sorted, ascending and descending in turn (see ``ordered``);
  memory holds one block.
- ``shard``: the whole shard is read first and fed sorted: the best reuse, at the cost of
  holding every pending row of the shard in memory.
- ``none``: source order.

What is written never depends on the order: the commit queue writes each batch sorted,
merge sorts each shard's parts, resume skips committed rows by their index, and seeds come
from the row and sample, not from when they were asked. Only the first LLM output is keyed,
and only when the steps before it are filters (a Python step may change its prompt): else
the order is the source order. A row whose key cannot be rendered (a template error, an
unreadable row) goes after the rows of its block; its error is raised and recorded when it runs.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Iterable, Iterator

from mirageflow.errors import RowError
from mirageflow.shard.steps.base import Step, first_engine_step

log = logging.getLogger(__name__)

MODES = ("none", "window", "shard")
BLOCK_WINDOWS = 4  # a window-mode block: this many in-flight windows of units


LAST = (1, "")  # the key of a row whose prompt cannot be rendered: after the others of its block


def ordered(units: Iterable, key: Callable, block: int | None) -> Iterator:
    """``units`` sorted by ``key`` within consecutive blocks of ``block`` (None: all at once).

    Blocks alternate ascending and descending (a serpentine): a block starts with the
    prefixes the previous one ended with, which the engine has just computed and still
    holds, instead of jumping back to the start of the key space, which an LRU cache smaller
    than a block has evicted by then. Rows keyed ``LAST`` stay at the end of every block.
    Equal keys keep their source order in ascending blocks."""
    it = iter(units)
    descending = False
    while True:
        chunk = list(itertools.islice(it, block)) if block else list(it)
        if not chunk:
            return
        keyed = sorted(((key(u), u) for u in chunk), key=lambda pair: pair[0])
        if descending:
            keyed = [p for p in reversed(keyed) if p[0] != LAST] + [p for p in keyed if p[0] == LAST]
        yield from (u for _, u in keyed)
        if not block:
            return
        descending = not descending


def prompt_key(extract, step) -> Callable:
    """The order key of a unit ``(dataset, row, sample)``: its prompt's messages as one string.

    A row that will fail (unreadable, a missing variable, a template error) sorts after the
    rows of its block: failures are not fed first, where they would weigh on the error
    budget's mid-run check (max_error_rate after min_rows_for_error_rate rows) more than
    they do in source order."""

    def key(unit) -> tuple[int, str]:
        row = unit[1]
        if row.value.__class__ is RowError:
            return LAST
        try:
            messages = step.builder.messages(extract(row.value))
        except Exception:  # noqa: BLE001 - only the order: the row raises again, and is recorded, when it runs
            return LAST
        return 0, "\x1e".join(f"{m.get('role')}\x1f{m.get('content')}" for m in messages)

    return key


def keyed_step(steps: list[Step]):
    """The first LLM step, when only filters come before it; else None."""
    at = first_engine_step(steps)
    return None if at is None else steps[at]


def feed_order(mode: str, units: Iterable, steps: list, extract, window: int) -> Iterable:
    """``units`` in the order ``mode`` asks for (see the module's docstring)."""
    if mode == "none":
        return units
    step = keyed_step(steps)
    if step is None:
        log.info("prefix_order %s: a Python step comes before the first LLM output; rows go in source order", mode)
        return units
    return ordered(units, prompt_key(extract, step), None if mode == "shard" else max(1, BLOCK_WINDOWS * window))
