"""How the report words its figures: the labels of row counts and the sentence on which
shards each figure covers (summary.md, report.html and the terminal use them alike)."""

from __future__ import annotations

from mirageflow.numbers import fmt

# the row counts' meaning, beside their keys (summary.md; report.html has its own labels)
ROW_LABELS = {
    "total_rows_processed": "rows ok",
    "total_rows_failed": "rows failed",
    "total_rows_filtered": "rows filtered (a filter step's predicate was false; not errors)",
    "rows_processed_failed_shards": "rows ok in failed shards",
}


def unit_note(agg: dict) -> str:
    """What a row count counts, when it is not source rows: " (samples: 2 records per row)"."""
    n = agg.get("n_samples") or 1
    return "" if n == 1 else f" (samples: {n} records per source row)"


def scope_sentence(agg: dict) -> str:
    """Which shards the figures cover, in one sentence (summary.md and report.html)."""
    failed = agg.get("failed_shards") or []
    text = (
        f"Failed rows (total_rows_failed, rows_failed_by_class) count completed and failed shards: "
        f"{fmt(agg.get('rows_failed_completed_shards'))} in completed shards, "
        f"{fmt(agg.get('rows_failed_failed_shards'))} in {len(failed)} failed shard(s)"
    )
    if failed:
        text += f" (which also committed {fmt(agg.get('rows_processed_failed_shards'))} rows ok)"
    return text + f"; every other figure covers the {agg['completed_shards']} completed shard(s) only."
