"""How many rows a static ``generate`` batch may hold so that it ends within a time budget.

Rows of a static batch that run to their length limit come back together, at the batch's
end: until then nothing of it can be committed, a stop loses all of it and the live line
does not move. The shard runner commits every ``execution_params.checkpoint_seconds``
(``Engine.commit_seconds``); a batch sized to end within half of that (the other half is
room for the estimate's error) loses at most one commit interval of work on a stop, however
long its rows' limits are. Rows that end earlier (their EOS) are handed back as they end
(transformers_engine's ``_early_rows``); this bounds the rest.

The estimate is seconds per decoding step per row, measured on every batch (its prefill
included, so it errs long). A step of b rows costs about a + c*b (a: paid by every step
whatever the batch, c: per row), so a small batch measures a higher figure per row; capping
with that figure converges on the batch that meets the budget (b' = T / (L (a/b + c)) has its
fixed point where (a + c*b) L = T). Until the first measurement a batch holds at most
``FIRST_ROWS`` rows. On a GPU the figure is so small that the cap is ``batch_size``.
"""

from __future__ import annotations

FIRST_ROWS = 4  # the first batch, before anything is measured: a cheap measurement
_WEIGHT = 0.5  # of the newest measurement in the running estimate (a shared machine's noise)


class BatchTimeCap:
    """The rows a batch of a given length limit may hold; ``observe`` each batch run."""

    def __init__(self, batch_size: int, commit_seconds: float | None):
        self.batch_size = batch_size
        # None: no budget (no runner commits: tests, benchmarks, preview): batch_size always
        self.budget = None if commit_seconds is None else commit_seconds / 2
        self.row_step_seconds: float | None = None  # seconds per decoding step per row

    def rows(self, max_new_tokens: int) -> int:
        """Rows a batch whose longest limit is ``max_new_tokens`` may hold (1..batch_size)."""
        if self.budget is None:
            return self.batch_size
        if self.row_step_seconds is None:
            return min(self.batch_size, FIRST_ROWS)
        fits = int(self.budget / (max(1, max_new_tokens) * self.row_step_seconds))
        return max(1, min(self.batch_size, fits))

    def observe(self, rows: int, steps: int, seconds: float) -> None:
        """A batch of ``rows`` rows ran ``steps`` decoding steps in ``seconds``."""
        if rows <= 0 or steps <= 0 or seconds <= 0:
            return
        measured = seconds / (steps * rows)
        previous = self.row_step_seconds
        self.row_step_seconds = measured if previous is None else _WEIGHT * measured + (1 - _WEIGHT) * previous

    def details(self) -> dict:
        """For status.json's engine details: the budget and what it allows now."""
        return {
            "budget_seconds": self.budget,
            "row_step_seconds": self.row_step_seconds,
        }
