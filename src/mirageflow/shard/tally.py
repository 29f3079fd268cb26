"""What the committed records hold: their answers, those cut at the length limit, those of
JSON outputs, their output tokens (those answered from the request cache told apart), and
the histogram of output tokens per record.

A record's tally (``UnitTally``) is taken as its row path renders it and committed with it:
each part's manifest entry holds the tally of the records in that part (shard/checkpoint.py),
and a shard's record figures are the sum over its intact parts. So they are the figures of
the records as they are, whatever history made them (an interrupt, a kill -9 between the
request cache's commit and the manifest's, a cached rerun, a damaged part recomputed): work
lost to an interrupt is in no part, and a record made again is counted once.

The per-attempt counters of shard/metrics.py count the work each attempt did instead
(``output_tokens``: tokens the engine generated, lost work included; the rates divide them).
"""

from __future__ import annotations

from mirageflow.stats.formulas import TokenHistogram

# status.json stats keys of the record figures (summed over the shard's parts)
RECORD_KEYS = (
    "record_answers", "record_answers_length_cut", "record_json_answers", "record_output_tokens", "record_output_tokens_cached",
)  # fmt: skip
HIST_KEY = "output_tokens_per_row_hist"  # tokens per record (a sample with n_samples > 1), answers of every LLM step


class UnitTally:
    """One record's answers, as its steps get them."""

    __slots__ = ("answers", "length_cut", "json_answers", "tokens", "cached_tokens", "llm_steps")

    def __init__(self):
        self.answers = self.length_cut = self.json_answers = self.tokens = self.cached_tokens = self.llm_steps = 0

    def book(self, request, completion, cached: bool) -> None:
        self.llm_steps += 1
        if completion.error_kind is None:
            self.answers += 1
            if completion.finish_reason == "length":
                self.length_cut += 1
            if request.json_schema is not None:
                self.json_answers += 1
        self.tokens += completion.completion_tokens
        if cached:
            self.cached_tokens += completion.completion_tokens


class RecordTally:
    """The sum of the tallies of some records (a part's, or a shard's)."""

    def __init__(self):
        self.counts = dict.fromkeys(RECORD_KEYS, 0)
        self.hist = TokenHistogram()
        self.records = 0

    def add(self, unit: UnitTally) -> None:
        c = self.counts
        self.records += 1
        c["record_answers"] += unit.answers
        c["record_answers_length_cut"] += unit.length_cut
        c["record_json_answers"] += unit.json_answers
        c["record_output_tokens"] += unit.tokens
        c["record_output_tokens_cached"] += unit.cached_tokens
        if unit.llm_steps:  # a record no LLM step made has no tokens to count
            self.hist.add(unit.tokens)

    def __bool__(self) -> bool:
        return self.records > 0

    def to_json(self) -> dict:
        return {**self.counts, HIST_KEY: self.hist.to_json()}

    @staticmethod
    def merge(entries: list[dict | None]) -> dict:
        """Several to_json() results summed (None: a part committed before tallies were kept, counted as nothing)."""
        entries = [e for e in entries if e]
        out = {k: sum(int(e.get(k) or 0) for e in entries) for k in RECORD_KEYS}
        out[HIST_KEY] = TokenHistogram.merge([e.get(HIST_KEY) for e in entries])
        return out


def valid_entry(entry) -> bool:
    """Whether a part's ``records`` entry can be summed (a damaged one is left out of the figures)."""
    if entry is None:
        return True
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in RECORD_KEYS):
        return False
    hist = entry.get(HIST_KEY)
    return isinstance(hist, dict) and isinstance(hist.get("buckets"), list) and isinstance(hist.get("rows"), int)
