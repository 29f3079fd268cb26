"""How many rows a static ``generate`` batch may hold so that it ends within a time budget.

Rows of a static batch that run to their length limit come back together, at the batch's
end: until then nothing of it can be committed, a stop loses all of it and the live line
does not move. The shard runner commits every ``execution_params.checkpoint_seconds``
(``Engine.commit_seconds``); a batch sized to end within half of that (the other half is
room for the estimate's error) loses at most one commit interval of work on a stop, however
long its rows' limits are. Rows that end earlier (their EOS) are handed back as they end
(transformers_generate's ``_early_rows``); this bounds the rest.

The cost model: a decoding step of b rows takes about a + c*b seconds (a: paid by every step
whatever the batch, reading the weights; c: per row), fitted by least squares to the steps
of the last batches (their prefill included, so it errs long). Until two batch sizes have
been seen, a is taken as 0 (every second per row: it errs small), and a batch holds at least
half the rows of the one seen (the second size the fit needs, without a step down to one row
whose rate nothing yet bounds). The first batch, before anything is measured, holds at most
``FIRST_ROWS`` rows.

The floor: on a CPU, a is most of a step, and a batch of one row decodes nearly as slowly as
a full one. A batch is never made so small that its throughput, b / (a + c*b), falls below
``MIN_THROUGHPUT`` of the full batch's: past that the budget gives way (a stop may lose more
than an interval) and the log says so once, with the two ways out (a longer
checkpoint_seconds, or ``continuous_batching: true``, where each row leaves as it ends). On a
GPU the cap is ``batch_size``.
"""

from __future__ import annotations

import logging
import math
from collections import deque

log = logging.getLogger(__name__)

FIRST_ROWS = 4  # the first batch, before anything is measured: a cheap measurement
MIN_THROUGHPUT = 0.8  # of the full batch's: the floor under the time budget
_KEPT = 16  # batches the fit reads (a shared machine's noise averages out)


class BatchTimeCap:
    """The rows a batch of a given length limit may hold; ``observe`` each batch run."""

    def __init__(self, batch_size: int, commit_seconds: float | None):
        self.batch_size = batch_size
        # None: no budget (no runner commits: tests, benchmarks, preview): batch_size always
        self.budget = None if commit_seconds is None else commit_seconds / 2
        self.steps: deque[tuple[int, float]] = deque(maxlen=_KEPT)  # (rows, seconds per decoding step)
        self._warned = False

    def cost(self) -> tuple[float, float] | None:
        """(a, c): a decoding step of b rows takes a + c*b seconds; None before any batch."""
        if not self.steps:
            return None
        sizes = [b for b, _ in self.steps]
        mean_b, mean_s = sum(sizes) / len(sizes), sum(s for _, s in self.steps) / len(self.steps)
        spread = sum((b - mean_b) ** 2 for b in sizes)
        if spread == 0:  # one size seen: all of it per row
            return 0.0, mean_s / mean_b
        c = sum((b - mean_b) * (s - mean_s) for b, s in self.steps) / spread
        if c <= 0:  # noise: a step costs the same whatever the rows
            return mean_s, 1e-12
        a = mean_s - c * mean_b
        return (a, c) if a >= 0 else (0.0, mean_s / mean_b)

    def rows(self, max_new_tokens: int) -> int:
        """Rows a batch whose longest limit is ``max_new_tokens`` may hold (1..batch_size)."""
        if self.budget is None:
            return self.batch_size
        cost = self.cost()
        if cost is None:
            return min(self.batch_size, FIRST_ROWS)
        a, c = cost
        steps = max(1, max_new_tokens)
        in_time = math.floor((self.budget / steps - a) / c)
        # b / (a + c b) >= MIN_THROUGHPUT * B / (a + c B)  <=>  b >= m B a / (a + (1 - m) B c)
        big = self.batch_size
        floor = math.ceil(MIN_THROUGHPUT * big * a / (a + (1 - MIN_THROUGHPUT) * big * c)) if a > 0 else 1
        sizes = {b for b, _ in self.steps}
        if len(sizes) == 1:  # a (the fixed cost) is unknown: half the size seen at least, which tells it
            floor = max(floor, next(iter(sizes)) // 2)
        rows = max(1, min(big, max(in_time, floor)))
        if in_time < floor and rows < big and not self._warned:
            self._warned = True
            why = "even one row takes that long" if rows == 1 else (
                f"fewer rows would cost more than {round(100 * (1 - MIN_THROUGHPUT))}% of the throughput"
            )  # fmt: skip
            log.warning(
                "transformers: a batch of %d row(s) with max_new_tokens %d takes about %.0f s, past half of checkpoint_seconds "
                "(%.0f s), and %s: a stop may lose that much work. continuous_batching: true (rows leave as they end) "
                "or a longer checkpoint_seconds avoids it",
                rows, steps, steps * (a + c * rows), self.budget, why,
            )  # fmt: skip
        return rows

    def observe(self, rows: int, steps: int, seconds: float) -> None:
        """A batch of ``rows`` rows ran ``steps`` decoding steps in ``seconds``."""
        if rows > 0 and steps > 0 and seconds > 0:
            self.steps.append((rows, seconds / steps))

    def details(self) -> dict:
        """For status.json's engine details: the budget and the step cost it was sized by."""
        cost = self.cost()
        return {
            "budget_seconds": self.budget,
            "step_seconds_fixed": None if cost is None else cost[0],
            "step_seconds_per_row": None if cost is None else cost[1],
        }
