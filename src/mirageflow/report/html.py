"""report.html: the metrics and plots of a run in one self-contained page (opens offline).

Plots are SVG drawn by report/svg.py (no plotting library to import: it was most of a small
run's report time) and embedded as data URIs; there are no scripts, fonts or links to fetch.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
from pathlib import Path

from mirageflow import numbers
from mirageflow.report.findings import findings_html
from mirageflow.report.wording import scope_sentence
from mirageflow.report.slurm_accounting import html_section
from mirageflow.report.svg import PALETTE, Figure, Panel, viridis
from mirageflow.state import layout as L
from mirageflow.state.records import DAMAGED_CONSEQUENCE, damaged_note, read
from mirageflow.stats import formulas as stats

log = logging.getLogger(__name__)

MAX_SHARD_ROWS = 500  # per-shard table rows shown; the rest are in metrics.json

CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Arial, sans-serif; margin: 24px auto; max-width: 1180px;
       color: #1d2433; background: #fff; padding: 0 16px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #dde2ea; padding-bottom: 4px; }
.sub { color: #5b6478; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.card { border: 1px solid #dde2ea; border-radius: 6px; padding: 10px 14px; min-width: 150px; background: #f7f9fc; }
.card .v { font-size: 20px; font-weight: 600; } .card .k { font-size: 12px; color: #5b6478; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #dde2ea; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #eef2f7; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 12px; } .note { color: #5b6478; font-style: italic; }
.bad { color: #b42318; } .plot { margin: 8px 0 16px; } .plot img { max-width: 100%; border: 1px solid #eef2f7; }
figcaption { color: #5b6478; font-size: 13px; margin-top: 4px; max-width: 1100px; }
.cols { display: flex; flex-wrap: wrap; gap: 24px; } .cols > div { flex: 1 1 480px; }
"""


def _esc(value) -> str:
    return html.escape(str(value))


def _fmt(value) -> str:
    if isinstance(value, (list, dict)):
        return json.dumps(value) if value else "none"
    return numbers.fmt(value)


def _svg(figure) -> str:
    """A report.svg.Figure as the base64 of its SVG (embedded by ``_img``)."""
    return base64.b64encode(figure.svg().encode()).decode()


# --------------------------------------------------------------------------- plots


def plot_shards(per_shard: list[dict], stragglers: set[int]) -> str | None:
    """Per-shard output tokens/s and runtime split into phases."""
    if not per_shard:
        return None
    ids = [s["shard_id"] for s in per_shard]
    st = [s["stats"] for s in per_shard]
    x = list(range(len(ids)))
    left = [i - 0.4 for i in x]
    rate = Panel("output tokens/s per shard (generation time)", "shard", "tokens/s")
    rate.bars(left, [s.get("tokens_per_sec") or 0 for s in st], 0.8, color="#3b6fb6")
    runtime = Panel("shard runtime (red outline: straggler, > 1.5 x median)" if stragglers else "shard runtime", "shard", "seconds")
    load = [s.get("model_load_seconds") or 0 for s in st]
    warm = [s.get("warmup_seconds") or 0 for s in st]
    gen = [s.get("generation_seconds") or s.get("inference_runtime_seconds") or 0 for s in st]
    other = [max(0.0, s["runtime_seconds"] - a - b - c) for s, a, b, c in zip(st, load, warm, gen)]
    bottom = [0.0] * len(x)
    edges = ["#b42318" if i in stragglers else None for i in ids]
    for values, label, color in (
        (load, "engine load", "#9aa5b8"),
        (warm, "warm-up", "#f0b429"),
        (gen, "generation", "#3b6fb6"),
        (other, "other", "#d8dde6"),
    ):
        if any(values):
            runtime.bars(left, values, 0.8, bottom, color, edges, label)
            bottom = [b + v for b, v in zip(bottom, values)]
    pad = max(0.0, (6 - len(x)) / 2)  # keep a few bars from filling the whole plot
    step = max(1, math.ceil(len(ids) / 20))
    for panel in (rate, runtime):
        panel.xlim = (-0.5 - pad, len(x) - 0.5 + pad)
        panel.xticks = [(i, str(ids[i])) for i in x[::step]]
        panel.ygrid_only = True
    return _svg(Figure(1100, 340, [rate, runtime], legend_width=90))


def load_gpu_samples(state_dir: str | Path, shard_ids: list[int], damaged: list[dict] | None = None) -> list[dict]:
    """The shards' GPU timelines; a damaged gpu_samples.json is skipped with a warning and added to ``damaged``."""
    out = []
    for shard_id in shard_ids:
        path = L.StateLayout(state_dir).gpu_samples(shard_id)
        data, why = read(path)
        if why:
            log.warning("%s; %s", damaged_note(path, why), DAMAGED_CONSEQUENCE[L.GPU_SAMPLES])
            if damaged is not None:
                damaged.append({"shard_id": shard_id, "file": L.GPU_SAMPLES, "path": str(path), "reason": why})
            continue
        if data and data.get("t"):
            out.append({**data, "shard_id": shard_id})
    return out


def _gpu_series(samples: list[dict]) -> list[tuple[str, list[float], list[float], list]]:
    """(label, starts, ends, utils) per GPU of each shard, in minutes on a common clock."""
    starts = {}
    for s in samples:
        try:
            starts[s["shard_id"]] = stats.parse_time(s["started_at"])
        except (KeyError, TypeError, ValueError):
            starts[s["shard_id"]] = None
    known = [t for t in starts.values() if t is not None]
    origin = min(known) if known else None
    out = []
    for s in samples:
        offset = (starts[s["shard_id"]] - origin).total_seconds() if origin and starts[s["shard_id"]] else 0.0
        durations = s.get("duration") or [s.get("interval_seconds") or 0.0] * len(s["t"])
        t0 = [(offset + t) / 60 for t in s["t"]]
        t1 = [(offset + t + d) / 60 for t, d in zip(s["t"], durations)]
        for gpu, series in zip(s.get("gpus") or [{}] * len(s["util"]), s["util"]):
            if any(v is not None for v in series):
                out.append((f"shard {s['shard_id']} GPU {gpu.get('index', '?')}", t0, t1, series))
    return out


def plot_gpu_util(samples: list[dict]) -> str | None:
    """GPU utilisation over time per GPU: lines for a few GPUs, a heatmap (one row per GPU) for more."""
    series = _gpu_series(samples)
    if not series:
        return None
    title, xlabel = "GPU utilisation over time, per GPU (NVML)", "minutes since the first shard's generation started"
    if len(series) <= 4:
        panel = Panel(title, xlabel, "GPU utilisation %")
        for k, (label, t0, t1, util) in enumerate(series):
            # each point holds its mean over [t0, t1): drawn as steps
            xs = [x for a, b in zip(t0, t1) for x in (a, b)]
            ys = [v for v in util for _ in (0, 1)]
            panel.line(xs, ys, PALETTE[k % len(PALETTE)], label=label)
        panel.ylim = (-2, 102)
        return _svg(Figure(1100, 340, [panel], legend_width=140))
    import bisect

    end = max(t1[-1] for _, _, t1, _ in series)
    cols = 300
    panel = Panel(title + " (colour: utilisation %, 0 dark to 100 yellow; grey: no sample)", xlabel,
                  "" if len(series) <= 40 else f"{len(series)} GPUs (by shard)")  # fmt: skip
    for row, (_, t0, t1, util) in enumerate(series):
        colors = []
        for col in range(cols):
            x = (col + 0.5) * end / cols
            k = bisect.bisect_right(t0, x) - 1
            value = util[k] if k >= 0 and x < t1[k] else None
            colors.append("#f2f4f7" if value is None else viridis(value))
        start = 0
        for col in range(1, cols + 1):  # one rectangle per run of one colour
            if col == cols or colors[col] != colors[start]:
                panel.cell(start * end / cols, len(series) - row - 1, col * end / cols, len(series) - row, colors[start])
                start = col
    panel.xlim, panel.ylim = (0, end), (0, len(series))
    panel.yticks = [(len(series) - i - 0.5, label) for i, (label, *_) in enumerate(series)] if len(series) <= 40 else []
    return _svg(Figure(1100, int(min(900, 160 + 22 * len(series))), [panel], margin_left=140 if len(series) <= 40 else 58))


def load_identity(state_dir: str | Path) -> dict | None:
    """What the run's records depend on (``<state_dir>/records.fingerprint``'s identity): model, sampling, outputs, datasets."""
    data, why = read(L.StateLayout(state_dir).fingerprint)
    identity = (data or {}).get("identity")
    return identity if isinstance(identity, dict) else None


DEFAULT_MAX_NEW_TOKENS = 128  # the engines' default (SGLang's)


def output_token_limits(identity: dict | None) -> list[tuple[str, int]] | None:
    """Each LLM output's max_new_tokens, in order: [(name, limit)] (None when unknown)."""
    if not identity:
        return None
    try:
        processors = identity.get("processors") or []
        outputs = (identity.get("processing_params") or {}).get("outputs") or []
        defaults = [(p.get("default_sampling_params") or {}).get("max_new_tokens") for p in processors]
        limits = []
        for o in outputs:
            if o.get("type", "llm") != "llm":
                continue
            limit = (o.get("sampling_params") or {}).get("max_new_tokens")
            if limit is None:
                known = {d for d in defaults if d is not None}
                limit = known.pop() if len(known) == 1 and len(defaults) == 1 else DEFAULT_MAX_NEW_TOKENS if not known else max(known)
            limits.append((str(o.get("name", "?")), int(limit)))
        return limits or None
    except (AttributeError, TypeError, ValueError):
        return None


def token_limit_label(limits: list[tuple[str, int]], unit: str = "row") -> str:
    """The histogram marker's label, per output and per row: "max_new_tokens 64 per output x 2 outputs = 128 per row"."""
    total = sum(n for _, n in limits)
    if len(limits) == 1:
        return f"max_new_tokens {total:,} (1 output per {unit})"
    values = {n for _, n in limits}
    if len(values) == 1:
        return f"max_new_tokens {limits[0][1]:,} per output x {len(limits)} outputs = {total:,} per {unit}"
    return "max_new_tokens " + " + ".join(f"{n:,} ({name})" for name, n in limits) + f" = {total:,} per {unit}"


def equal_width_bins(hist: dict, max_bins: int = 64) -> tuple[int, list[tuple[int, int, int]]]:
    """The histogram's buckets (exact below 16, then 8 per power of two) regrouped into bins of one width.

    The width is a power of two at least as wide as the widest bucket, so every bucket
    falls into exactly one bin: the counts stay exact. Returns (width, [(low, high, rows)]).
    """
    buckets = [(int(lo), int(hi), int(n)) for lo, hi, n in hist["buckets"] if n]
    if not buckets:
        return 1, []
    top = max(hi for _, hi, _ in buckets)
    width = 1
    while width < max(hi - lo for lo, hi, _ in buckets) or top / width > max_bins:
        width *= 2
    counts: dict[int, int] = {}
    for lo, _hi, n in buckets:
        start = lo // width * width
        counts[start] = counts.get(start, 0) + n
    first, last = min(counts), max(counts)
    return width, [(lo, lo + width, counts.get(lo, 0)) for lo in range(first, last + 1, width)]


def tokens_hist_labels(hist: dict, n_samples: int, width: int) -> tuple[str, str, str]:
    """(title, x label, y label) of the tokens histogram: per row, or per sample with n_samples > 1
    (the histogram counts records: a 60-row run with 2 samples has 120, not "120 rows")."""
    unit = "row" if n_samples == 1 else "sample"
    count = numbers.count(hist["rows"], unit)
    if n_samples > 1 and hist["rows"] % n_samples == 0:
        count += f" ({hist['rows'] // n_samples:,} rows x {n_samples})"
    title = f"tokens per {unit}: {count}, mean {hist['mean']:.1f}, max {hist['max']}"
    return title, f"output tokens per {unit} (all outputs of the {unit}; bins of {width})", f"{unit}s"


def plot_tokens_per_row(hist: dict | None, limits: list[tuple[str, int]] | None = None, n_samples: int = 1) -> str | None:
    """Output tokens per row (all its outputs) in equal-width bins, with the most a row can have
    marked and labelled per output and per row (``token_limit_label``).

    With n_samples > 1 the histogram counts samples (each is a record with its own outputs), and says so."""
    if not hist or not hist.get("rows"):
        return None
    limit = sum(n for _, n in limits) if limits else None
    width, bins = equal_width_bins(hist)
    panel = Panel(*tokens_hist_labels(hist, n_samples, width))
    panel.bars([lo for lo, _, _ in bins], [n for _, _, n in bins], width, color="#3b6fb6")
    right = bins[-1][1] if bins else 1
    if limit:
        unit = "row" if n_samples == 1 else "sample"
        panel.vline(limit, "#b42318", token_limit_label(limits, unit))
        right = max(right, limit)
    panel.xlim = (0, right * 1.04 + 1)
    panel.integer_x = panel.integer_y = panel.ygrid_only = True
    return _svg(Figure(540, 340, [panel]))


# --------------------------------------------------------------------------- throughput over time


def load_histories(state_dir: str | Path, shard_ids: list[int]) -> list[dict]:
    """Each shard's progress samples (progress.json ``history``: [seconds, samples, tokens]) with its
    start time and the second its generation began (None in files written before it was kept)."""
    out = []
    for shard_id in shard_ids:
        data, _why = read(L.StateLayout(state_dir).progress(shard_id))
        if data and len(data.get("history") or []) >= 2:
            out.append({
                "shard_id": shard_id, "started_at": data.get("started_at"), "history": data["history"],
                "generation_started": data.get("generation_started_seconds"),
            })  # fmt: skip
    return out


ROWS, TOKENS = 1, 2  # columns of a progress history sample [seconds, rows done, output tokens]


def work_windows(history: list, generation_started: float | None = None, column: int = TOKENS) -> list[tuple[float, float, float]]:
    """One count of the history (``column``: ROWS or TOKENS) cut into windows that contain
    work: [(t0, t1, growth)], each window ending at a sample where the count grew and starting
    where the previous one ended (the first at the start of generation, else at the first
    sample). A batch that finishes at once is so counted over the time it ran, not as one
    spike after zeros; rows that fail at once (no tokens) do not cut the tokens' windows.
    Samples after the last growth make a last window with nothing finished (the shard
    writing its records, or a stall at the end)."""
    points = sorted((float(sample[0]), float(sample[column] or 0)) for sample in history)
    if not points:
        return []
    t0, v0 = points[0]
    if generation_started is not None:
        before = [v for t, v in points if t <= generation_started]
        t0, v0 = max(float(generation_started), t0), (before[-1] if before else v0)
    out, last = [], t0
    for t, v in points:
        if t <= t0:
            continue
        last = t
        if v > v0:
            out.append((t0, t, v - v0))
            t0, v0 = t, v
    if last > t0:
        out.append((t0, last, 0.0))
    return out


def _offsets(histories: list[dict]) -> dict[int, float]:
    """Each shard's start in seconds after the first shard's (0 where a start is unknown)."""
    starts = {}
    for h in histories:
        try:
            starts[h["shard_id"]] = stats.parse_time(h["started_at"])
        except (KeyError, TypeError, ValueError):
            starts[h["shard_id"]] = None
    known = [t for t in starts.values() if t is not None]
    origin = min(known) if known else None
    return {k: (t - origin).total_seconds() if origin and t else 0.0 for k, t in starts.items()}


def throughput_series(histories: list[dict], column: int = TOKENS) -> list[tuple[int, list[float], list[float]]]:
    """(shard, minutes, rate per second) per shard on a common clock (minutes since the first
    shard started), one step per work window of ``column`` (``work_windows``)."""
    offsets = _offsets(histories)
    out = []
    for h in histories:
        offset = offsets[h["shard_id"]]
        xs, rates = [], []
        for t0, t1, grown in work_windows(h["history"], h.get("generation_started"), column):
            xs += [(offset + t0) / 60, (offset + t1) / 60]
            rates += [grown / (t1 - t0)] * 2
        if xs:
            out.append((h["shard_id"], xs, rates))
    return out


def rows_done_series(histories: list[dict]) -> list[tuple[int, list[float], list[float]]]:
    """(shard, minutes, rows done) per shard on the common clock: the progress samples as they are."""
    offsets = _offsets(histories)
    return [
        (h["shard_id"], [(offsets[h["shard_id"]] + t) / 60 for t, _, _ in h["history"]], [r or 0 for _, r, _ in h["history"]])
        for h in histories
    ]


def total_rows_done(series: list[tuple[int, list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """The run's rows done over time: every shard's count summed at every sample time (a
    shard counts its last sample until it ends, nothing before it starts)."""
    import numpy as np

    times = np.unique(np.concatenate([np.asarray(xs, dtype=float) for _, xs, _ in series])) if series else np.array([])
    total = np.zeros_like(times)
    for _, xs, rows in series:
        xs, rows = np.asarray(xs, dtype=float), np.asarray(rows, dtype=float)
        at = np.searchsorted(xs, times, side="right") - 1
        total += np.where(at >= 0, rows[np.clip(at, 0, None)], 0.0)
    return times.tolist(), total.tolist()


def total_rate(series: list[tuple[int, list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """The run's output tokens/s over time: the shards' window rates (``throughput_series``) summed
    where they overlap, as (minutes, tokens/s) steps."""
    changes: dict[float, float] = {}
    for _, xs, tokens in series:
        for i in range(0, len(xs) - 1, 2):  # each window is two points: (start, rate), (end, rate)
            changes[xs[i]] = changes.get(xs[i], 0.0) + tokens[i]
            changes[xs[i + 1]] = changes.get(xs[i + 1], 0.0) - tokens[i]
    times, rates, level = [], [], 0.0
    for t in sorted(changes):
        level += changes[t]
        times.append(t)
        rates.append(max(0.0, level))  # no float residue below zero
    return times, rates


MANY_SHARDS = 10  # above this: no legend, and both panels show the run's totals


def plot_throughput(histories: list[dict], unit: str = "rows") -> str | None:
    """Rows done over time (per shard, or the run's total with many shards) and output
    tokens/s per shard over windows that contain work (from the shards' progress samples)."""
    series = throughput_series(histories)
    if not series:
        return None
    done = rows_done_series(histories)
    many = len(series) > MANY_SHARDS
    xlabel = "minutes since the first shard started"
    rows = Panel(
        f"{unit} done over time, " + (f"all {len(done)} shards together" if many else "per shard"), xlabel, f"{unit} done (cumulative)"
    )
    tokens = Panel(
        f"output tokens/s, all {len(series)} shards together" if many else "output tokens/s per shard, over windows with work", xlabel, "tokens/s"
    )  # fmt: skip
    if many:
        rows.step(*total_rows_done(done), "#1d2433", width=1.5)
        tokens.step(*total_rate(series), "#1d2433", width=1.2)
    else:
        for k, (shard_id, xs, done_rows) in enumerate(done):
            rows.step(xs, done_rows, PALETTE[k % len(PALETTE)], label=f"shard {shard_id}")
        for k, (shard_id, xs, rates) in enumerate(series):
            tokens.line(xs, rates, PALETTE[k % len(PALETTE)], label=f"shard {shard_id}")
    for panel in (rows, tokens):
        values = [y for m in panel.marks if m[0] == "line" for y in m[2] if y is not None]
        panel.ylim = (0, max(values or [0.0]) * 1.05 or 1.0)
    rows.legend = []  # one legend (the shards' colours are the same in both panels)
    return _svg(Figure(1100, 330, [rows, tokens], legend_width=0 if many else 80))


THROUGHPUT_CAPTION = (
    "From each shard's progress samples (every 5 s, at most 240 per attempt; the last attempt of each shard). "
    "Left: {unit} done, counted when they finish (resumed and failed ones included): a flat stretch is time in "
    "which none finished (the model loading, a batch still generating, or a stall). Right: output tokens/s, each "
    "step the tokens of the {unit} finished in a window that ends when tokens were added and starts where the "
    "previous window ended (the first at the start of generation), so a batch that finishes at once is drawn at "
    "its average rate over the time it ran, not as one spike after zeros. A step at zero is a window in which no "
    "tokens were added: after the last {unit} (the shard writing its records) or a stall at the end. With more than 10 shards both panels show "
    "the run's total: {unit} done summed over the shards, and their tokens/s summed where they overlap."
)
SHARDS_CAPTION = (
    "Completed shards. Left: output tokens over the shard's generation time (all attempts); a bar at zero is a shard "
    "that generated no tokens (every row failed or was filtered). Right: the shard's wall time split into engine "
    "load, warm-up, generation and the rest (start-up, commits after generation, shutdown)."
)
GPU_CAPTION = (
    "NVML's utilisation of each GPU the shard holds, each sample held until the next. 0 % is a GPU that ran no "
    "kernel in that interval (the engine waiting for work, or between batches); a gap is a time with no samples."
)
TOKENS_CAPTION = (
    "Output tokens per {unit}, summed over the {unit}'s LLM outputs, in bins of one width: the records as they are "
    "(each counted once, whatever attempts made it; answers from the request cache included, and counted apart in "
    "total_record_output_tokens_cached)."
)
TOKENS_LIMIT_CAPTION = (
    " The dashed line is the most a {unit} can have: each output's max_new_tokens, summed over the outputs "
    "(a bar at it is a {unit} cut by the limit)."
)
ERRORS_CAPTION = "Failed rows per error class, in completed and failed shards (each failed row is in its shard's errors.jsonl)."


# --------------------------------------------------------------------------- examples


MAX_CELL = 400  # characters of a value shown in the example tables


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 3] + "..."


def example_records(state_dir: str | Path, shard_ids: list[int], n: int = 3) -> list[dict]:
    """The first records of the first shards that have any, read from their committed parts (checkpoint.json)."""
    out: list[dict] = []
    for shard_id in shard_ids[:50]:
        data, _why = read(L.StateLayout(state_dir).checkpoint(shard_id))
        for entry in ((data or {}).get("datasets") or {}).values():
            if not isinstance(entry, dict):
                continue
            for part in entry.get("parts") or []:
                if len(out) >= n:
                    return out
                try:
                    path = Path(entry["out_dir"]) / part["name"]
                    out += _read_records(path, entry.get("fmt"), n - len(out))
                except Exception as e:  # an example must never cost the report
                    log.debug("cannot read example records: %s", e)
    return out[:n]


def _read_records(path: Path, fmt: str | None, n: int) -> list[dict]:
    if fmt == "jsonl" or path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(rows) >= n:
                    break
                if line.strip():
                    rows.append(json.loads(line))
        return rows
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if pf.num_row_groups == 0:
        return []
    table = pf.read_row_group(0).slice(0, n)
    json_columns = {f.name for f in table.schema if (f.metadata or {}).get(b"mirageflow.encoding") == b"json"}
    rows = table.to_pylist()
    for row in rows:
        for k in json_columns & row.keys():
            if isinstance(row[k], str):
                try:
                    row[k] = json.loads(row[k])
                except ValueError:
                    pass
    return rows


def example_failed_rows(state_dir: str | Path, num_shards: int, n: int = 5, max_shards: int = 2000) -> list[dict]:
    """The first row errors (errors.jsonl) of the first shards that have any, with their shard."""
    out: list[dict] = []
    for shard_id in range(min(num_shards, max_shards)):
        path = L.StateLayout(state_dir).errors(shard_id)
        try:
            if path.stat().st_size == 0:
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if len(out) >= n:
                        return out
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(entry, dict):
                        out.append({"shard_id": shard_id, **entry})
        except OSError:
            continue
    return out


def plot_errors(by_class: dict) -> str | None:
    if not by_class:
        return None
    items = sorted(by_class.items(), key=lambda kv: kv[1])
    panel = Panel("failed rows by error class (completed and failed shards)", "rows")
    for i, (_, v) in enumerate(items):  # horizontal bars: rows along x, one class a line
        panel.cell(0, i + 0.15, v, i + 0.85, "#b42318")
    panel.xlim, panel.ylim = (0, max(v for _, v in items) * 1.12), (0, len(items))
    panel.yticks = [(i + 0.5, f"{k} ({v:,})") for i, (k, v) in enumerate(items)]
    panel.integer_x = True
    return _svg(Figure(540, int(max(160, 44 * len(items) + 90)), [panel], margin_left=170))


# --------------------------------------------------------------------------- page


def _examples_html(state_dir, done_ids: list[int], num_shards: int) -> list[str]:
    out = ["<h2>Example records</h2>"]
    try:
        records = example_records(state_dir, done_ids)
    except Exception:
        log.exception("reading example records failed")
        records = []
    if records:
        columns = list(dict.fromkeys(k for r in records for k in r))
        out.append('<p class="note">The first records of the first completed shards (from their committed parts).</p>')
        out.append("<table>" + "<tr>" + "".join(f"<th>{_esc(c)}</th>" for c in columns) + "</tr>")
        for r in records:
            out.append("<tr>" + "".join(f"<td>{_esc(_short(r.get(c, '')))}</td>" for c in columns) + "</tr>")
        out.append("</table>")
    else:
        out.append('<p class="note">No records to show.</p>')
    out.append("<h2>Failed rows (examples)</h2>")
    try:
        errors = example_failed_rows(state_dir, num_shards)
    except Exception:
        log.exception("reading failed rows failed")
        errors = []
    if errors:
        out.append(
            '<p class="note">The first failed rows of the first shards with any (<code>&lt;state_dir&gt;/shard_&lt;id&gt;/errors.jsonl</code>).</p>'
        )
        out.append(
            "<table><tr><th>shard</th><th>dataset</th><th>source index</th><th>stage</th><th>error class</th><th>message</th><th>model text</th></tr>"
        )
        for e in errors:
            out.append(
                f"<tr><td class=n>{_esc(e.get('shard_id'))}</td><td class=n>{_esc(e.get('dataset', ''))}</td>"
                f"<td class=n>{_esc(e.get('source_index', ''))}</td><td>{_esc(e.get('stage', ''))}</td>"
                f"<td class=bad>{_esc(e.get('error', ''))}</td><td>{_esc(_short(e.get('message', '')))}</td>"
                f"<td>{_esc(_short(e['raw'])) if e.get('raw') is not None else ''}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append('<p class="note">No row errors in the shards\' errors.jsonl.</p>')
    return out


# what the metrics table calls a key (the rest show their key)
LABELS = {
    "total_rows_processed": "rows ok (completed shards)",
    "total_rows_failed": "rows failed (completed and failed shards)",
    "rows_failed_completed_shards": "rows failed in completed shards",
    "rows_failed_failed_shards": "rows failed in failed shards",
    "total_rows_filtered": "rows filtered (dropped by a filter step; not errors)",
    "rows_processed_failed_shards": "rows ok in failed shards",
    "completed_shards": "shards completed",
    "total_shards": "shards",
    "missing_shards": "shards not done",
    "running_shards": "shards running",
    "pending_shards": "shards pending",
    "overall_throughput_rows_per_sec": "rows (ok) per second, wall clock while shards ran",
    "wall_clock_runtime_seconds": "wall clock while shards ran (time between invocations left out)",
    "wall_clock_span_seconds": "first shard start to last shard finish (time between invocations included)",
    "total_output_tokens": "output tokens the engines generated (every attempt; the rates divide these)",
    "total_record_output_tokens": "output tokens in the records (generated and from the request cache)",
    "total_record_output_tokens_cached": "... of which answered from the request cache",
    "total_record_answers": "answers in the records",
    "total_record_answers_length_cut": "answers in the records cut at max_new_tokens",
    "total_record_json_answers": "JSON answers in the records",
    "tokens_per_sec": "output tokens/s (generation time)",
    "tokens_per_sec_per_gpu": "output tokens/s per GPU",
    "gpu_days_per_billion_tokens": "GPU-days per billion output tokens",
    "total_input_tokens_each_choice": "input tokens, a prompt counted once per choice (as vLLM counts under native n)",
    "engine_restarts": "engines restarted or reloaded inside their jobs, each once (completed and failed shards)",
    "cost_usd": "US dollars spent by every shard's every attempt (completed, failed and running), at each processor's price",
    "cost_unpriced_tokens": "tokens of processors whose price is unknown, left out of the dollars (set processors[].pricing)",
    "cost_forecast_usd": "US dollars the whole run is forecast to cost, at the cost per row done so far (basis beside)",
}
_TABLE_SKIP = {
    "output_tokens_per_row_hist",
    "failed_shards",
    "figure_scope",
    "damaged_state_files",
    "rows_failed_by_class",
    "inference_servers",
}


def unit_note_sentence(agg: dict) -> str:
    n = agg.get("n_samples") or 1
    return (
        "" if n == 1 else f" With n_samples {n}, each source row makes {n} records (samples): the row counts above and below count samples."
    )


def metrics_table_rows(agg: dict) -> list[tuple[str, str, object]]:
    """(label, key, value) rows of the metrics table: a ``*_seconds`` figure and its ``*_human``
    twin are one row ("600.0 s (00:10:00)"); metrics.json keeps both keys."""
    rows = []
    for key, value in agg.items():
        if key in _TABLE_SKIP:
            continue
        if key.endswith("_human") and key[: -len("_human")] + "_seconds" in agg:
            continue  # shown with its _seconds twin
        if key == "stragglers":
            value = ", ".join(f"shard {s['shard_id']} ({s['x_median']:.1f}x median)" for s in value) or "none"
        twin = key[: -len("_seconds")] + "_human" if key.endswith("_seconds") else None
        if twin in agg and isinstance(value, (int, float)):
            value = f"{_fmt(value)} s ({agg[twin]})"
        label = LABELS.get(key) or key.replace("_", " ")
        rows.append((label, key, value))
    by_class = agg.get("rows_failed_by_class")
    if by_class:
        text = ", ".join(f"{k} {v:,}" for k, v in sorted(by_class.items(), key=lambda kv: -kv[1]))
        rows.append(("rows failed by error class", "rows_failed_by_class", text))
    return rows


def _img(svg: str | None, alt: str, missing: str, caption: str | None = None) -> str:
    """The plot with its caption (what it shows and what a zero means), or the note saying why
    there is none (``missing`` is trusted HTML)."""
    if svg is None:
        return f'<p class="note">{missing}</p>'
    below = f"<figcaption>{_esc(caption)}</figcaption>" if caption else ""
    return f'<figure class="plot"><img alt="{_esc(alt)}" src="data:image/svg+xml;base64,{svg}">{below}</figure>'


def _card(key: str, value: str) -> str:
    return f'<div class="card"><div class="v">{_esc(value)}</div><div class="k">{_esc(key)}</div></div>'


def _dedup_html(dedup: list[dict] | None) -> list[str]:
    """The dedup rule's counts per dataset (deduplication_params; none when it is off)."""
    if not dedup:
        return []
    cols = [("text field", "text_field"), ("rows in", "rows_in"), ("exact duplicates removed", "exact_duplicates_removed"),
            ("near duplicates removed", "near_duplicates_removed"), ("rows out", "rows_out"), ("rows without text", "rows_without_text")]  # fmt: skip
    out = [
        "<h2>Deduplication (after merge)</h2>",
        "<table><tr><th>dataset</th>" + "".join(f"<th>{_esc(c)}</th>" for c, _ in cols) + "</tr>",
    ]
    for d in dedup:
        if "error" in d:
            out.append(f"<tr class=bad><td colspan={len(cols) + 1}>{_esc(d['error'])}</td></tr>")
            continue
        out.append(
            f"<tr><td class=n>{_esc(_fmt(d.get('dataset')))}</td>"
            + "".join(f"<td class=n>{_esc(_fmt(d.get(k)))}</td>" for _, k in cols)
            + "</tr>"
        )
    out.append("</table>")
    return out


def _servers_html(per_shard: list[dict], total: dict | None) -> list[str]:
    """The inference servers' own figures (their /metrics: vllm_server, sglang_server with
    enable_metrics) per shard and engine, beside our token counts."""
    if not total:
        return []

    def rate(v):
        return "n/a" if v is None else f"{100 * v:.1f} %"

    out = [
        "<h2>Inference servers' own figures</h2>",
        f"<p class=\"note\">From each launched server's <code>/metrics</code> over the shard's last attempt. "
        f"Prefix-cache hit rate over all: {_esc(rate(total.get('prefix_cache_hit_rate')))}; longest queue "
        f"{_esc(_fmt(total.get('queue_length_max')))}; preemptions {_esc(_fmt(total.get('preemptions')))}; token totals "
        f"reconciled with the server's counters for {total['token_totals_reconciled']} of {total['engines']} engines.</p>",
        "<table><tr><th>shard</th><th>processor</th><th>engine</th><th>input tokens (ours)</th><th>prompt tokens (server)</th>"
        "<th>output tokens (ours)</th><th>generated tokens (server)</th><th>prefix-cache hit rate</th><th>queue max</th>"
        "<th>queue mean</th><th>running max</th><th>preemptions</th><th>tokens</th></tr>",
    ]
    for s in per_shard:
        for name, f in (s.get("server_metrics") or {}).items():
            t = f.get("tokens") or {}
            verdict = "agree" if t.get("reconciled") and not t.get("note") else (t.get("note") or "n/a")
            cls = "" if t.get("reconciled") else " class=bad"
            out.append(
                f"<tr><td class=n>{s['shard_id']}</td><td>{_esc(name)}</td><td>{_esc(f.get('backend') or '')}</td>"
                + "".join(f"<td class=n>{_esc(_fmt(v))}</td>" for v in (
                    t.get("input_tokens"), f.get("prompt_tokens"), t.get("output_tokens"), f.get("generation_tokens")))
                + f"<td class=n>{_esc(rate(f.get('prefix_cache_hit_rate')))}</td>"
                + "".join(f"<td class=n>{_esc(_fmt(f.get(k)))}</td>" for k in ("queue_length_max", "queue_length_mean", "running_max", "preemptions"))
                + f"<td{cls}>{_esc(verdict)}</td></tr>"
            )  # fmt: skip
    out.append("</table>")
    return out


def render_html(metrics: dict, state_dir: str | Path, title: str = "mirageflow run report") -> str:
    """report.html: its sections in order, each made by a function of its own."""
    agg = metrics["aggregate"]
    per_shard = metrics["per_shard"]
    damaged = list(agg.get("damaged_state_files") or [])
    samples = load_gpu_samples(state_dir, [s["shard_id"] for s in per_shard], damaged)
    identity = load_identity(state_dir)
    unit = "row" if (agg.get("n_samples") or 1) == 1 else "sample"  # what a record is: a row, or one of a row's n_samples
    plots = _plots(agg, per_shard, state_dir, samples, identity, unit)
    out = _head_html(agg, state_dir, title, unit)
    if "findings" in metrics:
        out.append(findings_html(metrics["findings"]))
    out += _damaged_html(damaged)
    out += _unfinished_html(agg)
    out += _failed_shards_html(agg.get("failed_shards"))
    out += _figures_html(plots, metrics, identity, unit)
    out += _examples_html(state_dir, [s["shard_id"] for s in per_shard], agg.get("total_shards") or 0)
    out += _metrics_html(agg, metrics.get("deduplication"))
    out += _per_shard_html(per_shard, {s["shard_id"] for s in agg.get("stragglers") or []})
    out += _servers_html(per_shard[:MAX_SHARD_ROWS], agg.get("inference_servers"))
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _plots(agg: dict, per_shard: list[dict], state_dir, samples, identity, unit: str) -> dict:
    """Each plot's image, or None (a plot that fails is logged: it must never cost the metrics)."""
    stragglers = {s["shard_id"] for s in agg.get("stragglers") or []}
    failed_ids = [f["shard_id"] for f in agg.get("failed_shards") or []]
    done_ids = [s["shard_id"] for s in per_shard]
    n_samples = agg.get("n_samples") or 1
    plots = {}
    for name, fn in (
        ("shards", lambda: plot_shards(per_shard, stragglers)),
        ("throughput", lambda: plot_throughput(load_histories(state_dir, sorted(done_ids + failed_ids)[:200]), unit + "s")),
        ("gpu", lambda: plot_gpu_util(samples)),
        ("tokens", lambda: plot_tokens_per_row(agg.get("output_tokens_per_row_hist"), output_token_limits(identity), n_samples)),
        ("errors", lambda: plot_errors(agg.get("rows_failed_by_class") or {})),
    ):
        try:
            plots[name] = fn()
        except Exception:  # a plot must never cost the metrics
            log.exception("plot %s failed", name)
            plots[name] = None
    return plots


def _head_html(agg: dict, state_dir, title: str, unit: str) -> list[str]:
    """The page's head, title, the cards of the main figures and what they cover."""

    def pct(v):
        return "n/a" if v is None else f"{v:.1f} %"

    units = unit + "s"  # with n_samples > 1 the counts are records
    cards = [
        ("shards completed", f"{agg['completed_shards']} / {agg['total_shards']}"),
        ("wall clock while shards ran", agg.get("wall_clock_runtime_human") or "n/a"),
        (f"{units} ok (completed shards)", _fmt(agg.get("total_rows_processed"))),
        (f"{units} failed (completed + failed shards)", _fmt(agg.get("total_rows_failed"))),
        (f"{units} filtered", _fmt(agg.get("total_rows_filtered"))),
        ("output tokens/s", _fmt(agg.get("tokens_per_sec"))),
        ("output tokens/s per GPU", _fmt(agg.get("tokens_per_sec_per_gpu"))),
        ("GPU-days per billion tokens", _fmt(agg.get("gpu_days_per_billion_tokens"))),
        ("mean GPU utilisation", pct(agg.get("mean_gpu_util_pct"))),
        ("roofline fraction", pct(None if agg.get("roofline_fraction") is None else 100 * agg["roofline_fraction"])),
    ]
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_esc(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1>",
        f'<p class="sub">state directory <code>{_esc(state_dir)}</code>; generated {_esc(stats.utc_now()[:19])} UTC; '
        'definitions of every figure: docs/report.md, "Numbers in the report".</p>',
        '<div class="cards">' + "".join(_card(k, v) for k, v in cards) + "</div>",
        f'<p class="note">{_esc(scope_sentence(agg) + unit_note_sentence(agg))}</p>',
    ]


def _damaged_html(damaged: list[dict]) -> list[str]:
    if not damaged:
        return []
    return [
        '<h2>Damaged state files</h2><ul class="bad">',
        *(f"<li>{_esc(damaged_note(x['path'], x['reason']))}; {_esc(DAMAGED_CONSEQUENCE.get(x['file'], 'ignored'))}</li>" for x in damaged),
        "</ul>",
    ]


def _unfinished_html(agg: dict) -> list[str]:
    """The shards still running or pending, and the GPU-hours they are projected to need."""
    unfinished = [
        ("running", agg.get("running_shards")),
        ("pending", agg.get("pending_shards")),
    ]
    notes = [f"{k}: {', '.join(map(str, v))}" for k, v in unfinished if v]
    if not notes:
        return []
    notes.append(f"projected GPU-hours remaining: {_fmt(agg.get('gpu_hours_remaining_estimate'))}")
    return [f'<p class="bad">Run in progress or incomplete. {_esc("; ".join(notes))}.</p>']


def _failed_shards_html(failed: list[dict] | None) -> list[str]:
    if not failed:
        return []
    out = [
        "<h2>Failed shards</h2><table><tr><th>shard</th><th>error</th><th>signal</th><th>attempt</th><th>attempts</th>"
        "<th>rows ok</th><th>rows failed</th><th>host</th><th>SLURM job</th></tr>"
    ]
    for f in failed:
        out.append(
            f"<tr><td class=n>{f['shard_id']}</td><td class=bad>{_esc(str(f.get('error') or '')[:500])}</td>"
            f"<td>{_esc(f.get('signal') or '')}</td><td class=n>{_esc(f.get('attempt') or '')}</td>"
            f"<td class=n>{_esc(_fmt(f.get('attempts')))}</td><td class=n>{_esc(_fmt(f.get('rows_processed')))}</td>"
            f"<td class=n>{_esc(_fmt(f.get('rows_failed')))}</td>"
            f"<td>{_esc(f.get('host') or '')}</td><td>{_esc(f.get('slurm_job_id') or '')}</td></tr>"
        )
    out.append("</table>")
    return out


def _figures_html(plots: dict, metrics: dict, identity, unit: str) -> list[str]:
    """The plots (shards, throughput over time, GPU utilisation, tokens per row, errors) and the cluster accounting."""
    agg = metrics["aggregate"]
    out = ["<h2>Shards</h2>"]
    out.append(_img(plots["shards"], "per-shard throughput and runtime", "No completed shard yet.", SHARDS_CAPTION))
    out.append("<h2>Throughput over time</h2>")
    out.append(
        _img(
            plots["throughput"], f"{unit}s done and output tokens/s per shard over time",
            "No progress samples (progress.json of the shards has no history: an older run, or no shard ran long enough).",
            THROUGHPUT_CAPTION.format(unit=unit + "s"),
        )
    )  # fmt: skip
    out.append("<h2>GPU utilisation</h2>")
    out.append(
        _img(
            plots["gpu"], "GPU utilisation over time",
            "No GPU samples: the run had no GPU, NVML was unavailable (see the shard logs), or "
            "stats was off (sample with <code>stats: true</code> in the config, "
            "<code>--config stats=true</code> or <code>mmirage run --stats</code>).",
            GPU_CAPTION,
        )
    )  # fmt: skip
    out += html_section(metrics.get("cluster_accounting"))  # beside the GPU figures
    out.append(f'<div class="cols"><div><h2>Tokens per {unit}</h2>')
    caption = TOKENS_CAPTION + (TOKENS_LIMIT_CAPTION if output_token_limits(identity) else "")
    out.append(_img(plots["tokens"], f"output tokens per {unit}", "No rows generated.", caption.format(unit=unit)))
    out.append("</div><div><h2>Errors</h2>")
    if plots["errors"] is None and agg.get("total_rows_failed"):  # failed rows without a class (older files)
        out.append(f'<p class="note">{_esc(_fmt(agg["total_rows_failed"]))} failed rows, without error classes.</p>')
    else:
        out.append(_img(plots["errors"], "failed rows by error class", "No failed rows.", ERRORS_CAPTION))
    out.append("</div></div>")
    return out


def _metrics_html(agg: dict, deduplication) -> list[str]:
    """Every aggregate figure with its key in metrics.json, the dedup counts, and which shards each figure covers."""
    out = ["<h2>Metrics</h2><table><tr><th>metric</th><th>key in metrics.json</th><th>value</th></tr>"]
    for label, key, value in metrics_table_rows(agg):
        cls = "n" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        out.append(
            f"<tr><td>{_esc(label)}</td><td><code>{_esc(key)}</code></td><td class='{cls}'>{_esc(_fmt(value) if not isinstance(value, str) else value)}</td></tr>"
        )
    out.append("</table>")
    out += _dedup_html(deduplication)
    out.append("<table><tr><th>the figures of</th><th>cover</th></tr>")
    out += [f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in (agg.get("figure_scope") or {}).items()]
    out.append("</table>")
    return out


# the per-shard table's figures: (column, key of the shard's stats)
_SHARD_COLUMNS = [
    ("rows ok", "rows_processed"), ("failed", "rows_failed"), ("filtered", "rows_filtered"), ("runtime s", "runtime_seconds"),
    ("load s", "model_load_seconds"), ("generation s", "inference_runtime_seconds"), ("idle s", "engine_idle_seconds"),
    ("output tokens", "output_tokens"), ("tok/s", "tokens_per_sec"), ("tok/s/GPU", "tokens_per_sec_per_gpu"),
    ("GPUs", "num_gpus"), ("GPU util %", "gpu_util_mean"), ("energy J", "gpu_energy_joules"),
    ("roofline", "roofline_fraction"),
]  # fmt: skip


def _per_shard_html(per_shard: list[dict], stragglers: set[int]) -> list[str]:
    """The completed shards, one row each (the first MAX_SHARD_ROWS), stragglers marked."""
    out = ["<h2>Per shard</h2>"]
    if len(per_shard) > MAX_SHARD_ROWS:
        out.append(f'<p class="note">The first {MAX_SHARD_ROWS} of {len(per_shard)} shards; all are in metrics.json.</p>')
    out.append('<p class="note">Completed shards; each row covers all attempts of the shard.</p>')
    out.append(
        "<table><tr><th>shard</th><th>attempts</th><th>host</th><th>GPU</th><th>engine</th>"
        + "".join(f"<th>{_esc(c)}</th>" for c, _ in _SHARD_COLUMNS)
        + "</tr>"
    )
    for s in per_shard[:MAX_SHARD_ROWS]:
        st = s["stats"]
        mark = ' title="straggler"' if s["shard_id"] in stragglers else ""
        out.append(
            f"<tr{' class=bad' if mark else ''}><td class=n{mark}>{s['shard_id']}</td><td class=n>{_esc(_fmt(s.get('attempts')))}</td>"
            f"<td>{_esc(s.get('hostname') or '')}</td><td>{_esc(s.get('gpu_name') or '')}</td>"
            f"<td>{_esc('; '.join(f'{k}: {v}' for k, v in (s.get('engines') or {}).items()))}</td>"
            + "".join(f"<td class=n>{_esc(_fmt(st.get(k)))}</td>" for _, k in _SHARD_COLUMNS)
            + "</tr>"
        )
    out.append("</table>")
    return out
