"""Findings: what the report's figures say to change, each with its evidence and its config key.

MMIRAGE's benchmarking page ends with a table of symptoms and remedies; this module
applies it (and a few more) to a run's metrics (``compute_metrics``: per_shard and
aggregate) and the shards' ``errors.jsonl``. Each rule is data (``RULES``: an id, a title,
the config key to change, a check); a check returns the evidence (the figure, measured)
and the threshold it crossed, or None. The thresholds are the named constants below,
listed in docs/report.md ("Findings"). The report (summary.md, report.html) shows the findings
first; ``mmirage stats --diagnose`` prints them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mirageflow.errors import RowErrorClass, is_deterministic
from mirageflow.state import layout as L
from mirageflow.stats import formulas as stats

# engine starved: the engine sat idle inside its generation window while the GPUs were underused
STARVED_MAX_OCCUPANCY = 0.80  # engine busy seconds / generation window below this ...
STARVED_MAX_GPU_UTIL_PCT = 60.0  # ... while the time-weighted mean GPU utilisation is below this
# in-flight window too small: the engine was kept full, decoded near its roofline at that batch,
# but the batch is small, so each decode step reads the weights for few tokens
WINDOW_MAX_SEQUENCES_PER_GPU = 64  # median in-flight sequences per GPU (roofline_batch) below this ...
WINDOW_MIN_OCCUPANCY = 0.90  # ... with the engine busy at least this share of its window ...
WINDOW_MIN_ROOFLINE_FRACTION = 0.50  # ... and at least this fraction of the roofline at that batch reached
# answers cut at max_new_tokens
LENGTH_CUT_MAX_SHARE = 0.05  # share of answers that stopped at the length limit
# JSON failing for one field
JSON_FIELD_MIN_ERRORS = 5  # schema failures naming one field: at least this many ...
JSON_FIELD_MIN_SHARE = 0.50  # ... and at least this share of all schema failures
JSON_ERROR_LINES_READ = 200_000  # errors.jsonl lines read per shard (a bound on the report's time)
# stragglers from dataset skew: a straggler (report.aggregate.STRAGGLER_FACTOR) whose rows are long
SKEW_MIN_TOKENS_PER_ROW_FACTOR = 1.5  # its tokens per row, over the median shard's
# model load dominating short shards
LOAD_MAX_SHARE = 0.25  # summed model load seconds / summed shard runtime
# error classes that repeat on retry
DETERMINISTIC_MIN_ROWS = 1  # failed rows of deterministic classes (errors.RowErrorClass.deterministic)

# the key to change for each deterministic row error class (errors.RowErrorClass)
CLASS_KEYS = {
    RowErrorClass.BAD_ROW: "loading_params.datasets (fix the rows errors.jsonl names)",
    RowErrorClass.INVALID_UNICODE: "loading_params.datasets (the rows), or the prompt",
    RowErrorClass.EXTRACT_ERROR: "processing_params.inputs[].key",
    RowErrorClass.MISSING_VARIABLE: "processing_params.inputs[] (key, default or optional)",
    RowErrorClass.TEMPLATE_ERROR: "processing_params.outputs[].prompt",
    RowErrorClass.BAD_CONVERSATION: "processing_params.outputs[].conversation",
    RowErrorClass.CHAT_TEMPLATE: "processors[].chat_template_kwargs, or the messages",
    RowErrorClass.CONTEXT_LENGTH: "server_args.extra_engine_args.context_length, or shorter prompts",
    RowErrorClass.REASONING_TRUNCATED: "sampling_params.max_new_tokens, or processors[].chat_template_kwargs (thinking off)",
    RowErrorClass.JSON_SCHEMA: "processing_params.outputs[].output_schema, or the prompt",
}


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    config_key: str  # what to change (a check may name a narrower one)
    remedy: str
    check: Callable[[RunFigures], tuple[str, str] | tuple[str, str, str] | None]  # (evidence, threshold[, key])


class RunFigures:
    """The figures the rules read: the metrics' aggregate and per-shard stats, errors.jsonl on demand."""

    def __init__(self, metrics: dict, state_dir: str | Path | None):
        self.agg = metrics.get("aggregate") or {}
        self.shards = [s.get("stats") or {} for s in metrics.get("per_shard") or []]
        self.by_id = {s["shard_id"]: s.get("stats") or {} for s in metrics.get("per_shard") or []}
        self.state_dir = state_dir
        self._json_fields: dict | None = None

    def total(self, key: str) -> float:
        return sum(s.get(key) or 0 for s in self.shards)

    def occupancy(self) -> float | None:
        """Engine busy seconds / generation window, over the completed shards."""
        window = self.agg.get("sum_inference_runtime_seconds") or 0
        if window <= 0:
            return None
        return max(0.0, 1 - (self.agg.get("sum_engine_idle_seconds") or 0) / window)

    def json_field_failures(self) -> dict[tuple[str, str], int]:
        """json_schema failures per (output, field), from every completed shard's errors.jsonl."""
        if self._json_fields is None:
            self._json_fields = {}
            if self.state_dir is not None:
                paths = L.StateLayout(self.state_dir)
                for shard_id in self.by_id:
                    for key in _schema_failures(paths.errors(shard_id)):
                        self._json_fields[key] = self._json_fields.get(key, 0) + 1
        return self._json_fields


_OUTPUT = re.compile(r"^output '([^']*)': (.*)$", re.S)
_REQUIRED = re.compile(r"^'([^']*)' is a required property")


def _schema_failures(path: Path):
    """(output, field) of each json_schema failure in one errors.jsonl (damaged lines skipped:
    the checkpoint's reader names them; here they are only not counted)."""
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    with f:
        for n, line in enumerate(f):
            if n >= JSON_ERROR_LINES_READ:
                return
            if RowErrorClass.JSON_SCHEMA.value not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if not isinstance(entry, dict) or entry.get("error") != RowErrorClass.JSON_SCHEMA:
                continue
            m = _OUTPUT.match(str(entry.get("message") or ""))
            if not m:
                continue
            output, detail = m.groups()
            for part in detail.split("; "):  # "<path>: <message>" per validation error
                where, _, what = part.partition(": ")
                if where == "<object>":
                    req = _REQUIRED.match(what)
                    where = req.group(1) if req else where
                yield output, where


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


# --------------------------------------------------------------------------- the checks


def engine_starved(f: RunFigures):
    occ, util = f.occupancy(), f.agg.get("mean_gpu_util_pct")
    if occ is None or util is None or occ >= STARVED_MAX_OCCUPANCY or util >= STARVED_MAX_GPU_UTIL_PCT:
        return None
    return (
        f"the engine was busy {_pct(occ)} of its generation window ({f.agg.get('sum_engine_idle_seconds', 0):.0f} s idle "
        f"of {f.agg['sum_inference_runtime_seconds']:.0f} s) while mean GPU utilisation was {util:.1f} %",
        f"occupancy < {_pct(STARVED_MAX_OCCUPANCY)} and GPU utilisation < {STARVED_MAX_GPU_UTIL_PCT:.0f} %",
    )


def window_too_small(f: RunFigures):
    batches = [s["roofline_batch"] for s in f.shards if s.get("roofline_batch")]
    fraction, occ = f.agg.get("roofline_fraction"), f.occupancy()
    if not batches or fraction is None or occ is None:
        return None
    batch = stats.percentile(batches, 50)
    if batch >= WINDOW_MAX_SEQUENCES_PER_GPU or occ < WINDOW_MIN_OCCUPANCY or fraction < WINDOW_MIN_ROOFLINE_FRACTION:
        return None
    return (
        f"median {batch:.0f} sequences in flight per GPU; the engine was busy {_pct(occ)} of its window and reached "
        f"{_pct(fraction)} of the decode roofline at that batch: the batch, not the engine, limits tokens/s",
        f"sequences per GPU < {WINDOW_MAX_SEQUENCES_PER_GPU}, occupancy >= {_pct(WINDOW_MIN_OCCUPANCY)}, "
        f"roofline fraction >= {_pct(WINDOW_MIN_ROOFLINE_FRACTION)}",
    )


def length_cut(f: RunFigures):
    # the answers the records hold (status files of before record_* count the attempts' answers)
    prefix = "record_" if any("record_answers" in s for s in f.shards) else ""
    answers, cut = f.total(prefix + "answers"), f.total(prefix + "answers_length_cut")
    if not answers or cut / answers <= LENGTH_CUT_MAX_SHARE:
        return None
    return (
        f"{_pct(cut / answers)} of answers ({int(cut):,} of {int(answers):,}) stopped at max_new_tokens",
        f"share cut > {_pct(LENGTH_CUT_MAX_SHARE)}",
    )


def json_field(f: RunFigures):
    fields = f.json_field_failures()
    total = sum(fields.values())
    if not total:
        return None
    (output, field), n = max(fields.items(), key=lambda kv: kv[1])
    if n < JSON_FIELD_MIN_ERRORS or n / total < JSON_FIELD_MIN_SHARE:
        return None
    return (
        f"{n:,} of {total:,} JSON schema failures ({_pct(n / total)}) are field '{field}' of output '{output}'",
        f">= {JSON_FIELD_MIN_ERRORS} failures and >= {_pct(JSON_FIELD_MIN_SHARE)} of schema failures on one field",
        f"processing_params.outputs[{output}].output_schema ('{field}'), or its prompt",
    )


def skew_stragglers(f: RunFigures):
    def tokens_per_row(st):
        rows = st.get("rows_processed") or 0
        return ((st.get("input_tokens") or 0) + (st.get("output_tokens") or 0)) / rows if rows else None

    per_row = [t for t in (tokens_per_row(s) for s in f.shards) if t]
    median = stats.percentile(per_row, 50)
    if not median:
        return None
    skewed = []
    for s in f.agg.get("stragglers") or []:
        t = tokens_per_row(f.by_id.get(s["shard_id"]) or {})
        if t and t / median >= SKEW_MIN_TOKENS_PER_ROW_FACTOR:
            skewed.append(f"shard {s['shard_id']} ({s['x_median']:.1f}x the median runtime, {t / median:.1f}x the tokens per row)")
    if not skewed:
        return None
    return (
        "long rows concentrated in slow shards: " + ", ".join(skewed) + f"; median {median:.0f} tokens per row",
        f"a straggler with >= {SKEW_MIN_TOKENS_PER_ROW_FACTOR}x the median shard's tokens per row",
    )


def load_dominates(f: RunFigures):
    load, runtime = f.agg.get("sum_model_load_seconds") or 0, f.agg.get("sum_shard_runtime_seconds") or 0
    if runtime <= 0 or load / runtime <= LOAD_MAX_SHARE:
        return None
    shared = f.agg.get("shared_engines")
    return (
        f"model load took {_pct(load / runtime)} of the shards' runtime ({load:.0f} s of {runtime:.0f} s"
        + (", engines already shared" if shared else ", each shard loads its own engine")
        + ")",
        f"load share > {_pct(LOAD_MAX_SHARE)}",
    )


def repeating_errors(f: RunFigures):
    by_class = {k: v for k, v in (f.agg.get("rows_failed_by_class") or {}).items() if is_deterministic(k) and v}
    n = sum(by_class.values())
    if n < DETERMINISTIC_MIN_ROWS:
        return None
    ranked = sorted(by_class.items(), key=lambda kv: -kv[1])
    keys = "; ".join(f"{k}: {CLASS_KEYS.get(RowErrorClass(k), 'the config or data')}" for k, _ in ranked)
    return (
        f"{n:,} failed rows are of classes a retry fails the same way: " + ", ".join(f"{k} {v:,}" for k, v in ranked),
        f">= {DETERMINISTIC_MIN_ROWS} row of a deterministic class (docs/troubleshooting.md: row error classes)",
        keys,
    )


RULES: tuple[Rule, ...] = (
    Rule("engine_starved", "The engine is starved", "shard_params.max_inflight, loading_params.batch_size",
         "the engine waited for Python (prompt rendering, custom steps, reading, writing): keep more rows in flight, "
         "or make the per-row work cheaper", engine_starved),
    Rule("window_too_small", "The in-flight window is too small for the roofline",
         "shard_params.max_inflight, server_args.extra_engine_args.max_running_requests",
         "raise the rows in flight (and the engine's running-request cap) so each decode step serves more sequences",
         window_too_small),
    Rule("length_cut", "Answers are cut at max_new_tokens", "sampling_params.max_new_tokens",
         "raise max_new_tokens, or ask for shorter answers in the prompt", length_cut),
    Rule("json_field", "JSON fails on one field", "processing_params.outputs[].output_schema",
         "the model cannot fill this field as the schema says: describe it in the prompt, or relax its schema", json_field),
    Rule("skew_stragglers", "Stragglers from dataset skew", "loading_params.num_shards",
         "long rows sit together in some shards: shuffle the dataset, or use more shards so they spread", skew_stragglers),
    Rule("load_dominates", "Model load dominates short shards", "execution_params.shards_per_engine",
         "share one loaded engine among several shards (shards_per_engine), or use fewer, larger shards", load_dominates),
    Rule("repeating_errors", "Row errors that will repeat on retry", "the key of each class (below)",
         "`mmirage retry` (retry_failed_rows) fails these rows the same way: fix the config, prompt or data first",
         repeating_errors),
)  # fmt: skip


def diagnose(metrics: dict, state_dir: str | Path | None = None) -> list[dict]:
    """The findings of a run: one dict per rule that fires (id, title, evidence, threshold, config_key, remedy)."""
    figures = RunFigures(metrics, state_dir)
    out = []
    for rule in RULES:
        hit = rule.check(figures)
        if hit is None:
            continue
        evidence, threshold, *key = hit
        out.append({"id": rule.id, "title": rule.title, "evidence": evidence, "threshold": threshold,
                    "config_key": key[0] if key else rule.config_key, "remedy": rule.remedy})  # fmt: skip
    return out


def findings_markdown(findings: list[dict]) -> list[str]:
    """summary.md's Findings section (its lines)."""
    lines = ["## Findings", ""]
    if not findings:
        return lines + ['None: no figure crossed a threshold (docs/report.md, "Findings").', ""]
    for x in findings:
        lines.append(f"- **{x['title']}** ({x['id']}): {x['evidence']} [threshold: {x['threshold']}]. "
                     f"Change `{x['config_key']}`: {x['remedy']}.")  # fmt: skip
    return lines + [""]


def findings_text(findings: list[dict]) -> str:
    """`mmirage stats --diagnose`'s output."""
    if not findings:
        return 'no findings: no figure crossed a threshold (docs/report.md, "Findings")\n'
    out = []
    for x in findings:
        out += [f"{x['title']} [{x['id']}]", f"  evidence:  {x['evidence']}", f"  threshold: {x['threshold']}",
                f"  change:    {x['config_key']}", f"  why:       {x['remedy']}", ""]  # fmt: skip
    return "\n".join(out)


def findings_html(findings: list[dict]) -> str:
    """report.html's Findings section."""
    from html import escape

    if not findings:
        return '<h2 id="findings">Findings</h2><p class="note">None: no figure crossed a threshold (docs/report.md, "Findings").</p>'
    items = "".join(
        f"<li><b>{escape(x['title'])}</b> <code>{escape(x['id'])}</code>: {escape(x['evidence'])} "
        f'<span class="note">[threshold: {escape(x["threshold"])}]</span><br>change <code>{escape(x["config_key"])}</code>: '
        f"{escape(x['remedy'])}.</li>"
        for x in findings
    )
    return f'<h2 id="findings">Findings</h2><ul class="findings">{items}</ul>'
