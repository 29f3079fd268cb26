"""The shard's error budget: row outcomes in, a verdict out. Plain bookkeeping, no I/O."""

from __future__ import annotations

from collections import Counter

from mirageflow.shard.failures import ShardFailed


class ErrorBudget:
    """Counts ok, failed and filtered rows (committed by earlier attempts plus this one) and
    says when the shard has failed: more than ``max_errors`` failed rows, a failure rate
    above ``max_error_rate`` once ``min_rows_for_error_rate`` rows are done, or, at the end,
    every row failed (never a silent empty output).

    A filtered row (a filter step's predicate was false) is neither ok nor failed: it counts
    as a finished row in the rate's denominator (it went through its steps without error),
    and a shard whose rows were all filtered, or filtered and failed, has not "every row
    failed"."""

    def __init__(self, params, shard_id: int, errors_path):
        self.params, self.shard_id, self.errors_path = params, shard_id, errors_path
        self.resumed_ok = 0
        self.resumed_failed: Counter = Counter()
        self.ok_now = 0
        self.failed_now: Counter = Counter()
        self.resumed_filtered = self.filtered_now = 0
        self._rate_applies = False  # once it does, a successful row cannot break the budget

    def resume(self, ok: int, failed_classes: Counter, filtered: int = 0) -> None:
        """What earlier attempts committed."""
        self.resumed_ok, self.resumed_failed, self.resumed_filtered = ok, Counter(failed_classes), filtered

    @property
    def computed(self) -> int:
        """Rows finished by this attempt."""
        return self.ok_now + sum(self.failed_now.values()) + self.filtered_now

    def totals(self) -> tuple[int, int]:
        """(ok, failed) over all attempts."""
        return self.resumed_ok + self.ok_now, sum(self.resumed_failed.values()) + sum(self.failed_now.values())

    @property
    def filtered(self) -> int:
        """Filtered rows over all attempts."""
        return self.resumed_filtered + self.filtered_now

    def failed_classes(self) -> Counter:
        return self.resumed_failed + self.failed_now

    def record_ok(self) -> ShardFailed | None:
        self.ok_now += 1
        return None if self._rate_applies else self._verdict(final=False)

    def record_filtered(self) -> ShardFailed | None:
        self.filtered_now += 1
        return None if self._rate_applies else self._verdict(final=False)

    def record_failure(self, kind: str) -> ShardFailed | None:
        self.failed_now[kind] += 1
        return self._verdict(final=False)

    def final(self) -> ShardFailed | None:
        return self._verdict(final=True)

    def _verdict(self, final: bool) -> ShardFailed | None:
        done, failed = self.totals()
        total = done + failed + self.filtered
        p = self.params
        too_many = p.max_errors is not None and failed > p.max_errors
        rate_applies = total >= p.min_rows_for_error_rate or (final and total > 0)
        self._rate_applies = self._rate_applies or (rate_applies and not final)
        too_often = rate_applies and failed / total > p.max_error_rate
        all_failed = final and failed and not done and not self.filtered
        if not (too_many or too_often or all_failed):
            return None
        classes = ", ".join(f"{k}: {v}" for k, v in self.failed_classes().most_common())
        what = "every row of" if all_failed else "error budget exceeded in"
        filtered = f" ({self.filtered} filtered)" if self.filtered else ""
        return ShardFailed(
            f"{what} shard {self.shard_id}: {failed} of {total} rows{filtered} failed ({classes}); "
            f"max_error_rate {p.max_error_rate}, max_errors {p.max_errors}; see {self.errors_path}"
        )
