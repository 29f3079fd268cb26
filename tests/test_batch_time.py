"""The time cap on a static batch's rows (engines/batch_time.py), on step costs of a known shape."""

from __future__ import annotations

import pytest

from mirageflow.engines.batch_time import FIRST_ROWS, MIN_THROUGHPUT, BatchTimeCap


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


def test_the_first_batch_is_small_then_the_cap_is_the_batch_that_meets_the_budget():
    # a step costs 20 ms + 5 ms a row; 256 tokens in a 30 s budget (checkpoint_seconds 60):
    # (0.02 + 0.005 b) * 256 = 30  ->  b = 19.4
    cap = BatchTimeCap(64, 60)
    sizes = _run(cap, 256, 0.02, 0.005, 6)
    assert sizes[0] == FIRST_ROWS
    assert sizes[2:] == [19, 19, 19, 19], sizes  # once two sizes are seen the fit is exact
    assert all((0.02 + 0.005 * b) * 256 <= 30 for b in sizes)  # no batch ever past the budget
    assert cap.cost() == pytest.approx((0.02, 0.005))


def test_a_fast_device_keeps_batch_size():
    fast = BatchTimeCap(32, 60)  # the first small batch takes its fixed cost for per-row cost: it errs low, then climbs
    assert _run(fast, 512, 0.01, 0.0001, 4)[2:] == [32, 32]


def test_the_budget_gives_way_before_the_throughput_falls_below_the_floor(caplog):
    """A step that costs mostly the same whatever the rows (a CPU reading the weights): one row
    a batch would meet no budget anyway and decode at a fraction of the full batch's rate."""
    slow = BatchTimeCap(32, 60)
    sizes = _run(slow, 4096, 0.5, 0.1, 4)
    # b / (0.5 + 0.1 b) >= 0.8 * 32 / (0.5 + 3.2)  <=>  b >= 11.2
    assert sizes[2:] == [12, 12], sizes
    rate = [b / (0.5 + 0.1 * b) for b in (12, 32)]
    assert rate[0] >= MIN_THROUGHPUT * rate[1]
    assert sum("past half of checkpoint_seconds" in r.message for r in caplog.records) == 1  # said once


@pytest.mark.parametrize("rows, steps, seconds", [(0, 5, 1.0), (3, 0, 1.0), (3, 5, 0.0)])
def test_a_batch_that_decoded_nothing_teaches_nothing(rows, steps, seconds):
    cap = BatchTimeCap(32, 60)
    cap.observe(rows, steps, seconds)
    assert cap.cost() is None and cap.rows(100) == FIRST_ROWS
