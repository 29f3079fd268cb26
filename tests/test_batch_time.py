"""The time cap on a static batch's rows (engines/batch_time.py), on step costs of a known shape."""

from __future__ import annotations

import pytest

from mirageflow.engines.batch_time import FIRST_ROWS, BatchTimeCap


def _run(cap: BatchTimeCap, limit: int, per_step: float, per_row: float, batches: int) -> list[int]:
    """The rows of ``batches`` consecutive batches when a step of b rows costs per_step + per_row*b."""
    sizes = []
    for _ in range(batches):
        b = cap.rows(limit)
        sizes.append(b)
        cap.observe(b, limit, limit * (per_step + per_row * b))
    return sizes


def test_without_a_budget_a_batch_is_batch_size():
    cap = BatchTimeCap(32, None)
    assert _run(cap, 256, 0.5, 0.5, 3) == [32, 32, 32]


def test_the_first_batch_is_small_then_the_cap_converges_on_the_batch_that_meets_the_budget():
    # a step costs 20 ms + 5 ms a row; 256 tokens in a 30 s budget (checkpoint_seconds 60):
    # (0.02 + 0.005 b) * 256 = 30  ->  b = 19.4
    cap = BatchTimeCap(64, 60)
    sizes = _run(cap, 256, 0.02, 0.005, 12)
    assert sizes[0] == FIRST_ROWS
    assert sizes[-3:] == [19, 19, 19], sizes
    assert all((0.02 + 0.005 * b) * 256 <= 30 for b in sizes)  # no batch ever past the budget


def test_a_fast_device_keeps_batch_size_and_a_slow_one_goes_down_to_one_row():
    fast = BatchTimeCap(32, 60)  # the first small batch measures its fixed cost per row: it errs low, then climbs
    assert _run(fast, 512, 0.01, 0.0001, 4)[2:] == [32, 32]
    slow = BatchTimeCap(32, 60)
    assert _run(slow, 4096, 0.5, 0.1, 3)[1:] == [1, 1]  # a row alone takes 2458 s: one row a batch


@pytest.mark.parametrize("rows, steps, seconds", [(0, 5, 1.0), (3, 0, 1.0), (3, 5, 0.0)])
def test_a_batch_that_decoded_nothing_teaches_nothing(rows, steps, seconds):
    cap = BatchTimeCap(32, 60)
    cap.observe(rows, steps, seconds)
    assert cap.row_step_seconds is None and cap.rows(100) == FIRST_ROWS
