"""The state files' shapes, their checks, and the one way to read them: ``read``.

Every state file is a JSON object written atomically by its owner (the shard job, the
lease thread, the progress thread). A reader never trusts one: ``read(path)`` returns the
content, nothing when the file is absent, or why it is damaged (unreadable, not JSON, not
an object, or a field the readers compute with has the wrong type). A damaged file is
named in a one-line warning and in the report, never a crash (``damaged_note``,
``DAMAGED_CONSEQUENCE``).

The shapes are TypedDicts (the files stay plain JSON; the names document what each field
is): ``StatusRecord`` (``status.json``, written last and only on success), ``FailureRecord``
(``failure.json``), ``ProgressRecord`` (``progress.json``), ``LeaseRecord`` (``lease.json``)
and ``ShardStats`` (their ``stats``: sums over the shard's attempts, ``AttemptRecord`` each).

Units: with ``n_samples`` > 1 a shard's unit of work is a sample (one record per sample);
``rows_*`` counts in ``stats`` are records/units (MMIRAGE's names, kept), and ``n_samples``
says how many of them make a row. progress.json counts both: ``samples_*`` (units) and
``rows_*`` (source rows whose every sample is finished).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypedDict

from mirageflow.numbers import is_int, is_number, show
from mirageflow.state import layout

# --------------------------------------------------------------------------- shapes


class AttemptRecord(TypedDict, total=False):
    attempt: int  # the shard's own attempt number: 1, 2, ... over every run of the workflow
    snakemake_attempt: int  # Snakemake's retry number of the job that ran it (the time limit grows with it)
    started_at: str
    finished_at: str | None
    outcome: str  # running | success | failed | interrupted | killed
    error: str | None
    hostname: str
    pid: int
    slurm_job_id: str | None
    runtime_seconds: float
    rows_computed: int  # units this attempt finished
    output_tokens: int


@dataclass(frozen=True)
class StatsField:
    """One key of a shard's ``stats`` (status.json, failure.json): the one list of them is ``STATS_FIELDS``."""

    name: str
    type: object  # its JSON value, as a Python type (``ShardStats`` is made of them)
    summed: bool = False  # a per-attempt counter (``AttemptRecord``) the shard sums over its attempts (shard/metrics.py)
    number: bool = False  # the report does arithmetic on it: a finite, non-negative number, or null (``check_stats``)
    required: bool = False  # a successful shard's figures cannot do without it
    optional: bool = False  # written only where it applies (every other key is always written, maybe null)


_F = StatsField
_NUM = float | int | None
# Every key shard/metrics.py:ShardMetrics.stats writes, in its order; the writer, ``ShardStats``, the
# checks (``STATS_NUMBERS``, ``STATS_REQUIRED``) and the sums over attempts (``STATS_SUMMED``) all come
# from here (tests/test_state_contract.py pins the writer's keys). A new figure is one line here, and
# its value in ``ShardMetrics.stats`` (or, for a summed one, in ``ShardMetrics.attempt_entry``).
STATS_FIELDS: tuple[StatsField, ...] = (
    # sums over the attempts
    _F("runtime_seconds", float, summed=True, number=True, required=True),
    _F("model_load_seconds", float, summed=True, number=True),
    _F("warmup_seconds", float, summed=True, number=True),
    _F("generation_seconds", float, summed=True, number=True),
    _F("inference_runtime_seconds", float, summed=True, number=True, required=True),
    _F("write_seconds", float, summed=True, number=True),
    _F("engine_busy_seconds", float, summed=True, number=True),
    _F("engine_idle_seconds", float, summed=True, number=True),
    _F("engine_idle_gaps", int, summed=True, number=True),
    _F("rows_computed", int, summed=True, number=True),  # units the attempts finished
    _F("requests", int, summed=True, number=True),
    _F("input_tokens", int, summed=True, number=True),
    _F("output_tokens", int, summed=True, number=True, required=True),
    _F("gpu_seconds_allocated", float, summed=True, number=True),
    _F("images", int, summed=True, number=True),
    _F("image_tokens", int, summed=True, number=True),
    _F("input_tokens_each_choice", int, summed=True, number=True),
    _F("requests_cached", int, summed=True, number=True),
    _F("answers", int, summed=True, number=True),
    _F("answers_length_cut", int, summed=True, number=True),
    _F("json_answers", int, summed=True, number=True),
    _F("engine_restarts", int, summed=True, number=True),  # launched servers restarted in the job (engines/server_restarts.py)
    # dollars the answers' tokens cost at their processors' prices, and the GPU-hours at gpu_hour_usd (stats/pricing.py)
    _F("cost_usd", float, summed=True, number=True),
    _F("unpriced_tokens", int, summed=True, number=True),  # tokens of processors whose price is unknown (not in cost_usd)
    # the shard's units
    _F("n_samples", int, number=True),  # records (samples) per source row; the rows_* counts below are records
    _F("runtime_human", str),
    _F("peak_inflight", int, number=True),  # the largest of the attempts'
    _F("rows_processed", int, number=True),  # records written (units)
    _F("rows_failed", int, number=True),
    _F("rows_filtered", int, number=True),
    _F("rows_failed_by_class", dict[str, int]),
    _F("rows_resumed", int, number=True),
    _F("throughput_rows_per_sec", _NUM),
    _F("num_gpus", int, number=True, required=True),
    # rates from the sums (stats/formulas.py rate_figures, wall_rate_figures)
    _F("tokens_per_sec", _NUM),
    _F("tokens_per_sec_per_gpu", _NUM),
    _F("gpu_days_per_billion_tokens", _NUM),
    _F("tokens_per_sec_per_gpu_wall", _NUM),
    _F("gpu_days_per_billion_tokens_wall", _NUM),
    # this attempt's GPU samples (stats/gpu.py GpuSampler.summary)
    _F("gpu_util_mean", _NUM, number=True),
    _F("gpu_util_min", _NUM),
    _F("gpu_util_max", _NUM),
    _F("gpu_util_samples", _NUM),
    _F("gpu_sampled_seconds", _NUM, number=True),
    _F("gpu_sample_interval_seconds", _NUM),
    _F("gpu_memory_used_max_mb", _NUM),
    _F("gpu_energy_joules", _NUM, number=True),
    _F("gpus", list[dict]),
    _F("joules_per_1k_output_tokens", _NUM),
    # the decode roofline (stats/formulas.py roofline_figures)
    _F("roofline_tokens_per_sec_per_gpu", _NUM, number=True),
    _F("roofline_fraction", _NUM),
    _F("roofline_batch", _NUM),
    _F("roofline_mean_context", _NUM),
    # what the committed records hold (shard/tally.py RecordTally)
    _F("record_answers", int, number=True),
    _F("record_answers_length_cut", int, number=True),
    _F("record_json_answers", int, number=True),
    _F("record_output_tokens", int, number=True),
    _F("record_output_tokens_cached", int, number=True),
    _F("output_tokens_per_row_hist", dict),
    # each death of a launched server, every attempt's, oldest first: {attempt, processor, class, at, cause, ...}
    _F("engine_deaths", list[dict]),
    _F("attempts", list[AttemptRecord]),
    # what the request cache holds at the end (shard_params.request_cache on): {answers_kept, bytes}
    _F("request_cache", dict, optional=True),
)
STATS_KEYS = tuple(f.name for f in STATS_FIELDS)
# per-attempt counters that add up over attempts
STATS_SUMMED = tuple(f.name for f in STATS_FIELDS if f.summed)
# stats keys the report does arithmetic on: each a finite, non-negative number, or null when present
STATS_NUMBERS = tuple(f.name for f in STATS_FIELDS if f.number)
# ... and those a successful shard's figures cannot do without
STATS_REQUIRED = tuple(f.name for f in STATS_FIELDS if f.required)
# status.json's and failure.json's ``stats``, key by key (a plain JSON object; the names document it)
ShardStats = TypedDict("ShardStats", {f.name: f.type for f in STATS_FIELDS}, total=False)  # type: ignore[misc]


class StatusRecord(TypedDict, total=False):
    status: str  # "success"
    shard_id: int
    num_shards: int
    attempt: int
    records_fingerprint: str  # <state_dir>/records.fingerprint's sha256 when the shard ran
    hostname: str
    started_at: str
    finished_at: str
    hardware: dict
    datasets: list[dict]  # per dataset: row_range, rows_processed, parts, ...
    stats: ShardStats
    engines: dict  # processor -> its engine's info (backend, versions, details)
    server_metrics: dict | None  # processor -> its inference server's own figures (engines/server_metrics.py)


class FailureRecord(TypedDict, total=False):
    status: str  # "failed"
    shard_id: int
    error: str
    signal: str | None
    failure_class: str | None  # the class of the engine death that ended it (an EngineDeathClass value)
    attempt: int
    hostname: str
    finished_at: str
    records_fingerprint: str
    stats: ShardStats | None


class ProgressRecord(TypedDict, total=False):
    shard_id: int
    phase: str  # starting | loading | warmup | generating | writing | done | failed
    n_samples: int
    rows_total: int  # source rows of the shard
    rows_done: int  # source rows whose every sample is finished (resumed ones included)
    samples_total: int  # units: rows_total x n_samples
    samples_done: int  # finished (committed or about to be), resumed ones included
    samples_committed: int  # durable in part files / errors.jsonl / the manifest
    inflight: int  # requests in the engine now
    rows_per_sec: float | None  # over the rate window; None when nothing finished in it
    samples_per_sec: float | None
    tokens_per_sec: float | None
    eta_seconds: float | None  # only from a measured rate
    eta_note: str | None  # why there is no ETA
    cost_usd: float  # dollars of every attempt so far (stats' cost_usd, live)
    unpriced_tokens: int  # tokens of processors whose price is unknown
    updated_at_unix: float
    hostname: str
    pid: int


class LeaseRecord(TypedDict, total=False):
    hostname: str
    pid: int
    slurm_job_id: str | None
    token: str
    heartbeat: float


class DamagedFile(TypedDict):
    file: str  # status.json, failure.json, ...
    path: str
    reason: str


# --------------------------------------------------------------------------- checks


def _check_numbers(d: dict, keys, prefix: str = "", required: bool = False, figures: bool = False) -> str | None:
    """Why one of ``keys`` is not a finite number (``figures``: a finite, non-negative one,
    as every figure the report sums must be), naming it; None when all are."""
    for k in keys:
        v = d.get(k)
        if v is None and not required:
            continue
        if not is_number(v):
            infinite = isinstance(v, float)  # NaN, Infinity: is_number refuses only those of the floats
            return f"{prefix}{k} is {'missing' if k not in d else show(v)}, not a {'finite ' if infinite else ''}number"
        if figures and v < 0:
            return f"{prefix}{k} is {show(v)}, a negative figure"
    return None


def _check_counts(d, prefix: str) -> str | None:
    """Why an object of counts (``rows_failed_by_class``) is not one: every value a finite,
    non-negative number, named by its key when not."""
    if not isinstance(d, dict):
        return f"{prefix} is {show(d)}, not an object of counts"
    return _check_numbers(d, list(d), f"{prefix}.", required=True, figures=True)


def _check_strings(d: dict, keys, prefix: str = "") -> str | None:
    for k in keys:
        if d.get(k) is not None and not isinstance(d[k], str):
            return f"{prefix}{k} is {show(d[k])}, not a string"
    return None


def _check_time(d: dict, key: str) -> str | None:
    from mirageflow.stats.formulas import parse_time

    v = d.get(key)
    try:
        if isinstance(v, str) and parse_time(v).tzinfo is not None:
            return None
    except ValueError:
        pass
    return f"{key} is {'missing' if key not in d else show(v)}, not a timestamp with a UTC offset"


def _check_hist(h) -> bool:
    if h is None:
        return True
    if not isinstance(h, dict) or not isinstance(h.get("buckets"), list):
        return False
    if not all(isinstance(b, list) and len(b) == 3 and all(is_number(x) for x in b) for b in h["buckets"]):
        return False
    return (
        _check_numbers(h, ("rows", "sum"), required=True, figures=True) is None and _check_numbers(h, ("min", "max"), figures=True) is None
    )


def check_stats(st, required: tuple = ()) -> str | None:
    """Why a ``stats`` dict (status.json or failure.json) cannot be used, or None."""
    if not isinstance(st, dict):
        return f"stats is {show(st)}, not an object"
    why = _check_numbers(st, required, "stats.", required=True, figures=True) or _check_numbers(st, STATS_NUMBERS, "stats.", figures=True)
    if why:
        return why
    by_class = st.get("rows_failed_by_class")
    if by_class is not None and (why := _check_counts(by_class, "stats.rows_failed_by_class")):
        return why
    gpus = st.get("gpus")
    if gpus is not None and not (
        isinstance(gpus, list) and all(isinstance(g, dict) and (g.get("util_mean") is None or is_number(g["util_mean"])) for g in gpus)
    ):
        return "stats.gpus is not a list of GPU objects"
    if not _check_hist(st.get("output_tokens_per_row_hist")):
        return "stats.output_tokens_per_row_hist is not a token histogram"
    attempts = st.get("attempts")
    if attempts is not None and not (isinstance(attempts, list) and all(isinstance(a, dict) for a in attempts)):
        return "stats.attempts is not a list of attempt objects"
    return None


def check_status(status: dict, shard_id: int | None = None) -> str | None:
    """Why a status.json cannot be used, or None. Only a successful one needs its stats and times."""
    if not isinstance(status.get("status"), str):
        return f"status is {'missing' if 'status' not in status else show(status['status'])}, not a string"
    if status.get("shard_id") is not None and shard_id is not None and status["shard_id"] != shard_id:
        return f"shard_id is {show(status['shard_id'])}, not {shard_id}"
    if status.get("num_shards") is not None and not is_int(status["num_shards"]):
        return f"num_shards is {show(status['num_shards'])}, not an integer"
    if status.get("records_fingerprint") is not None and not isinstance(status["records_fingerprint"], str):
        return f"records_fingerprint is {show(status['records_fingerprint'])}, not a string"
    if status["status"] != "success":
        return None
    return (
        _check_time(status, "started_at") or _check_time(status, "finished_at")
        or _check_strings(status, ("hostname",))
        or (None if status.get("hardware") is None or isinstance(status["hardware"], dict) else "hardware is not an object")
        or check_stats(status.get("stats"), STATS_REQUIRED)
    )  # fmt: skip


def check_failure(failure: dict) -> str | None:
    if not isinstance(failure.get("error"), str):
        return f"error is {'missing' if 'error' not in failure else show(failure['error'])}, not a string"
    why = _check_strings(failure, ("signal", "hostname", "finished_at"))
    if why:
        return why
    return None if failure.get("stats") is None else check_stats(failure["stats"])


def check_lease(lease: dict) -> str | None:
    return _check_numbers(lease, ("heartbeat",), required=True) or _check_strings(lease, ("hostname",))


# progress.json fields its readers (`mmirage status`, the terminal, the report) compute with or print
PROGRESS_NUMBERS = (
    "phase_seconds", "rows_done", "rows_failed", "rows_total", "fraction_done", "output_tokens", "rows_per_sec",
    "tokens_per_sec", "rate_window_seconds", "eta_seconds", "queue_depth", "inflight", "elapsed_seconds",
    "updated_at_unix", "num_gpus", "attempt", "n_samples", "samples_done", "samples_total", "samples_committed",
    "samples_per_sec", "pid", "generation_started_seconds",
)  # fmt: skip
PROGRESS_STRINGS = ("phase", "eta_human", "eta_note", "started_at", "updated_at", "hostname")


def check_progress(state: dict) -> str | None:
    """Why a progress.json object cannot be used (a field of the wrong type), or None.

    ``phase`` is required; every other field may be missing or null, but the ones present
    must have the type the progress reporter writes.
    """
    if not isinstance(state.get("phase"), str):
        return f"phase is {'missing' if 'phase' not in state else show(state['phase'])}, not a string"
    why = _check_numbers(state, PROGRESS_NUMBERS) or _check_strings(state, PROGRESS_STRINGS)
    if why:
        return why
    if state.get("slurm_job_id") is not None and not isinstance(state["slurm_job_id"], (str, int)):
        return "slurm_job_id is not a string"
    history = state.get("history")
    if history is not None and not (
        isinstance(history, list) and all(isinstance(h, list) and len(h) == 3 and all(is_number(x) for x in h) for h in history)
    ):
        return "history is not a list of [seconds, rows, tokens] samples"
    return None


def check_gpu_samples(data: dict) -> str | None:
    """Why a gpu_samples.json object cannot be plotted, or None."""
    t = data.get("t")
    if t is None:
        return None  # nothing sampled: no plot, nothing wrong
    if not isinstance(t, list) or not all(is_number(x) for x in t):
        return "t is not a list of numbers"
    util = data.get("util")
    if not isinstance(util, list) or not all(
        isinstance(u, list) and len(u) == len(t) and all(v is None or is_number(v) for v in u) for u in util
    ):
        return "util is not a list of per-GPU series as long as t"
    duration = data.get("duration")
    if duration is not None and not (isinstance(duration, list) and len(duration) == len(t) and all(is_number(x) for x in duration)):
        return "duration is not a list of numbers as long as t"
    if data.get("interval_seconds") is not None and not is_number(data["interval_seconds"]):
        return "interval_seconds is not a number"
    gpus = data.get("gpus")
    if gpus is not None and not (isinstance(gpus, list) and all(isinstance(g, dict) for g in gpus)):
        return "gpus is not a list of objects"
    if data.get("started_at") is not None and not isinstance(data["started_at"], str):
        return "started_at is not a string"
    return None


# the check of each state file, by its name (read() picks it)
CHECKS: dict[str, Callable[[dict], str | None]] = {
    layout.STATUS: check_status,
    layout.FAILURE: check_failure,
    layout.PROGRESS: check_progress,
    layout.LEASE: check_lease,
    layout.GPU_SAMPLES: check_gpu_samples,
}


# --------------------------------------------------------------------------- reading


def read(path: str | os.PathLike, check: Callable[[dict], str | None] | None = None) -> tuple[dict | None, str | None]:
    """(content, None); (None, None) when the file is absent; (None, why) when it is damaged.

    Damaged: unreadable, not JSON, not a JSON object, or the file's check says why not
    (``check``, else the one of its name in ``CHECKS``; other files are only parsed).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read it ({e.strerror or e})"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError: random bytes
        return None, f"not JSON ({str(e).splitlines()[0][:80]})" if raw.strip() else "empty file"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__ if not isinstance(data, list) else 'array'}, not an object"
    check = check if check is not None else CHECKS.get(path.name)
    why = check(data) if check is not None else None
    return (None, why) if why else (data, None)


# what the report and `mmirage status` make of a damaged file
DAMAGED_CONSEQUENCE = {
    layout.STATUS: "the shard is not counted as done (failed); delete the file and rerun the shard (mmirage retry)",
    layout.FAILURE: "the shard counts as failed, without its error and stats",
    layout.PROGRESS: "ignored (the shard's state comes from its other files)",
    layout.LEASE: "ignored (the shard's state comes from its other files)",
    layout.GPU_SAMPLES: "ignored (no GPU timeline for the shard)",
}


def damaged_note(path: str | os.PathLike, why: str) -> str:
    return f"damaged state file {path}: {why}"
