"""The canary (``execution_params.canary_rows: N``): shard 0's first N rows, run before any shard.

A prompt that makes the model loop, a schema it cannot fill, a max_new_tokens too short:
each shard would find the same problem, after thousands of GPU-hours. The
canary finds it first. The workflow's ``canary`` rule runs the real shard runner on the
first N rows of shard 0, in a state directory of its own (``StateLayout.canary_state``:
copies of the datasets' indices and the records fingerprint, ``shard_0/``, its request
cache) and an output directory of its own (``canary_output``), then judges the shard's
quality counters (``judge``) against the thresholds below. Passing, it hands its request
cache to shard 0 (``seed_shard_cache``: shard 0 then sends none of the canary's requests
again) and writes ``canary/verdict.json``, an input of every shard rule, so Snakemake starts no shard (and on
SLURM submits none) before it exists; failing, it writes ``canary/failed.json`` and
raises ``CanaryFailed`` naming each counter over its threshold and the key to change. No
scheduler of ours: Snakemake's dependencies do the holding, under both profiles.

The thresholds are docs/canary.md's; the counters are the shard's stats
(``answers``, ``answers_length_cut``, ``json_answers``, ``rows_failed_by_class``). Every row
error class counts: the answer classes (``ANSWER_CLASSES``) in their own counters, every
other class (a template's error, a missing input key, an image, the data) in
``other_row_errors_rate``, of the rows run, whatever ``max_error_rate`` allows the shards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

from mirageflow.config.types import PipelineConfig
from mirageflow.errors import MirageflowError
from mirageflow.errors import RowErrorClass as E
from mirageflow.files import atomic_write_json
from mirageflow.state.layout import StateLayout
from mirageflow.state.records import read
from mirageflow.state.shards import job_fingerprint

log = logging.getLogger(__name__)

CANARY_MIN_VALID_JSON = 0.95  # JSON answers that parse and match their schema, of all JSON answers
CANARY_MAX_EMPTY_OUTPUT = 0.02  # empty_output rows, of all answers
CANARY_MAX_JSON_TRUNCATED = 0.02  # json_truncated rows, of JSON answers
CANARY_MAX_REASONING_TRUNCATED = 0.02  # reasoning_truncated rows, of all answers
CANARY_MAX_LENGTH_CUT = 0.05  # answers that stopped at max_new_tokens, of all answers
CANARY_MAX_OTHER_ROW_ERRORS = 0.02  # rows failed by any other class (template_error, image_*, ...), of rows run

JSON_FAILURES = (E.JSON_PARSE, E.JSON_SCHEMA, E.JSON_TRUNCATED)
# the classes the answer counters judge; every other class counts in other_row_errors_rate
ANSWER_CLASSES = (*JSON_FAILURES, E.EMPTY_OUTPUT, E.REASONING_TRUNCATED)


class CanaryFailed(MirageflowError, RuntimeError):
    """The canary's counters did not pass: no shard starts."""


@dataclasses.dataclass(frozen=True)
class Counter:
    name: str
    threshold: float
    at_most: bool  # the rate must stay at or below the threshold (else at or above it)
    change: str  # what to change when it fails


COUNTERS = (
    Counter("valid_json_rate", CANARY_MIN_VALID_JSON, False,
            "processing_params.outputs[].output_schema or the prompt (errors.jsonl has each failed answer)"),
    Counter("empty_output_rate", CANARY_MAX_EMPTY_OUTPUT, True,
            "sampling_params.max_new_tokens, or processors[].chat_template_kwargs (thinking off), or allow_empty_output"),
    Counter("json_truncated_rate", CANARY_MAX_JSON_TRUNCATED, True, "sampling_params.max_new_tokens (raise it)"),
    Counter("reasoning_truncated_rate", CANARY_MAX_REASONING_TRUNCATED, True,
            "sampling_params.max_new_tokens (raise it), or processors[].chat_template_kwargs (thinking off)"),
    Counter("length_cut_share", CANARY_MAX_LENGTH_CUT, True,
            "sampling_params.max_new_tokens (raise it), or ask for shorter answers in the prompt"),
    Counter("other_row_errors_rate", CANARY_MAX_OTHER_ROW_ERRORS, True,
            "what the classes name: a prompt or record template, an input key, the images, the data "
            "(errors.jsonl has each failed row; docs/troubleshooting.md, \"Row error classes\")"),
)  # fmt: skip


def other_classes(stats: dict) -> dict[str, int]:
    """The rows failed by a class no answer counter judges, by class."""
    by_class = stats.get("rows_failed_by_class") or {}
    return {k: n for k, n in sorted(by_class.items()) if k not in ANSWER_CLASSES and n}


def rates(stats: dict) -> dict[str, float | None]:
    """The canary's counters from a shard's stats (None: nothing to divide by)."""
    by_class = stats.get("rows_failed_by_class") or {}
    answers, json_answers = stats.get("answers") or 0, stats.get("json_answers") or 0

    def share(n, d):
        return n / d if d else None

    json_failed = sum(by_class.get(k, 0) for k in JSON_FAILURES)
    rows_run = sum(stats.get(k) or 0 for k in ("rows_processed", "rows_failed", "rows_filtered"))
    return {
        "valid_json_rate": None if not json_answers else max(0.0, 1 - json_failed / json_answers),
        "empty_output_rate": share(by_class.get(E.EMPTY_OUTPUT, 0), answers),
        "json_truncated_rate": share(by_class.get(E.JSON_TRUNCATED, 0), json_answers),
        "reasoning_truncated_rate": share(by_class.get(E.REASONING_TRUNCATED, 0), answers),
        "length_cut_share": share(stats.get("answers_length_cut") or 0, answers),
        "other_row_errors_rate": share(sum(other_classes(stats).values()), rows_run),
    }


def judge(stats: dict) -> dict:
    """The verdict on a canary shard's stats: passed, each counter with its threshold, the problems."""
    values = rates(stats)
    counters, problems = {}, []
    for c in COUNTERS:
        v = values[c.name]
        ok = v is None or (v <= c.threshold if c.at_most else v >= c.threshold)
        counters[c.name] = {"value": v, "threshold": c.threshold, "at_most": c.at_most, "ok": ok}
        if not ok:
            bound = "at most" if c.at_most else "at least"
            classes = "; " + ", ".join(f"{k} {n}" for k, n in other_classes(stats).items()) if c.name == "other_row_errors_rate" else ""
            problems.append(f"{c.name} is {100 * v:.1f} % ({bound} {100 * c.threshold:.0f} % to pass{classes}): change {c.change}")
    return {
        "passed": not problems, "counters": counters, "problems": problems,
        "rows_processed": stats.get("rows_processed"), "rows_failed": stats.get("rows_failed"),
        "rows_failed_by_class": stats.get("rows_failed_by_class") or {},
        "answers": stats.get("answers"), "json_answers": stats.get("json_answers"),
    }  # fmt: skip


def canary_config(cfg: PipelineConfig) -> PipelineConfig:
    """The pipeline as the canary runs it: its own state_dir and output_dirs, everything else the same."""
    paths = StateLayout(cfg.state_dir)
    datasets = [dataclasses.replace(ds, output_dir=str(paths.canary_output / f"dataset_{ds.index}")) for ds in cfg.datasets]
    return dataclasses.replace(cfg, state_dir=str(paths.canary_state), datasets=datasets, run_state_dir=cfg.state_dir)


def _prepare(cfg: PipelineConfig, canary: PipelineConfig) -> None:
    """The canary's state_dir: the datasets' indices and the records fingerprint, copied; no
    verdict of an earlier canary left (a shard must never take an old one for this one's)."""
    main, own = StateLayout(cfg.state_dir), StateLayout(canary.state_dir)
    main.canary_failed.unlink(missing_ok=True)
    for ds in cfg.datasets:
        for src, dst in ((main.dataset_index(ds.index), own.dataset_index(ds.index)),
                         (main.dataset_offsets(ds.index), own.dataset_offsets(ds.index))):  # fmt: skip
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    if main.fingerprint.exists():
        shutil.copyfile(main.fingerprint, own.fingerprint)


def run_canary(cfg: PipelineConfig, verdict_path: str | Path, attempt: int = 1, **run_kwargs) -> dict:
    """Run the canary rows and write the verdict (``verdict_path`` when it passed, else
    ``canary/failed.json`` and CanaryFailed). A shard failure (its error budget, a crash)
    is judged too: its counters name the cause where they can; otherwise it is raised as is."""
    from mirageflow.shard.runner import run_shard

    rows = cfg.execution.canary_rows
    if not rows:
        raise CanaryFailed("execution_params.canary_rows is not set: there is no canary to run")
    canary = canary_config(cfg)
    paths, own = StateLayout(cfg.state_dir), StateLayout(canary.state_dir)
    Path(verdict_path).unlink(missing_ok=True)
    fingerprint = job_fingerprint(cfg)
    earlier, _why = read(paths.canary_failed)
    if attempt > 1 and earlier and earlier.get("records_fingerprint") == fingerprint and earlier.get("canary_rows") == rows:
        # a retry (the profile's retries) of a canary that failed its counters would fail the same way
        raise CanaryFailed(_message(paths, earlier, rows) + " (an earlier attempt's verdict: not run again)")
    _prepare(cfg, canary)
    try:
        status = run_shard(canary, 0, attempt=attempt, row_limit=rows, **run_kwargs)
    except Exception as e:
        failure, _why = read(own.failure(0))
        verdict = judge((failure or {}).get("stats") or {})
        verdict["shard_error"] = f"{type(e).__name__}: {e}"
        if verdict["passed"]:
            raise
        return _failed(paths, verdict, rows, fingerprint)
    verdict = judge(status["stats"])
    if not verdict["passed"]:
        return _failed(paths, verdict, rows, fingerprint)
    verdict.update(canary_rows=rows, records_fingerprint=fingerprint)
    verdict["answers_handed_to_shard_0"] = seed_shard_cache(cfg, canary)
    atomic_write_json(Path(verdict_path), verdict)
    log.info("canary passed on %d rows: %s", rows, json.dumps(verdict["counters"]))
    return verdict


def seed_shard_cache(cfg: PipelineConfig, canary: PipelineConfig) -> int:
    """Give shard 0 the canary's request cache, so the canary's rows are not asked twice:
    its answers are shard 0's first rows' answers (same requests, same keys). Only when
    shard 0 has no request cache of its own yet (it has not started: every shard waits for
    the verdict, written after this); the copy is made whole under a temporary name, then
    renamed into place. Returns the answers handed over (0: none)."""
    from mirageflow.shard.request_cache import CACHE_DIR, MANIFEST

    source = StateLayout(canary.state_dir).shard_dir(0) / CACHE_DIR
    target = StateLayout(cfg.state_dir).shard_dir(0) / CACHE_DIR
    if not cfg.shard.request_cache or not (source / MANIFEST).exists():
        return 0
    if target.exists():
        log.info("shard 0 has a request cache already (%s): the canary's answers are not handed over", target)
        return 0
    tmp = target.with_name(f".{CACHE_DIR}.canary.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a copy a killed canary left
    try:
        segments = json.loads((source / MANIFEST).read_text())["segments"]
        tmp.mkdir(parents=True)
        for name in [*(seg["name"] for seg in segments), MANIFEST]:
            shutil.copyfile(source / name, tmp / name)
        os.replace(tmp, target)
    except (OSError, ValueError, KeyError, TypeError) as e:
        # only a saving: shard 0 then asks the canary's rows again (its own cache checks what it reads)
        log.warning("canary: its answers were not handed to shard 0 (%s: %s: %s); shard 0 asks its rows again",
                    source / MANIFEST, type(e).__name__, e)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    handed = sum(seg.get("entries", 0) for seg in segments)
    log.info("canary: %d answers handed to shard 0's request cache (%s)", handed, target)
    return handed


def _failed(paths: StateLayout, verdict: dict, rows: int, fingerprint: str) -> dict:
    verdict.update(canary_rows=rows, records_fingerprint=fingerprint)
    atomic_write_json(paths.canary_failed, verdict)
    raise CanaryFailed(_message(paths, verdict, rows))


def _message(paths: StateLayout, verdict: dict, rows: int) -> str:
    return (
        f"the canary ({rows} rows of shard 0) failed, no shard was started: " + "; ".join(verdict["problems"])
        + f". Its records are in {paths.canary_output}, its failed rows in {StateLayout(paths.canary_state).errors(0)}; "
        f"the verdict in {paths.canary_failed}."
    )  # fmt: skip
