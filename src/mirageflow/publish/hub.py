"""``mmirage publish`` and the publish rule: a run's records and card to a Hugging Face dataset repo.

What is uploaded is staged in ``<state_dir>/publish/staging/``, laid out as the repo:
``README.md`` (the card, the one written beside merged/) and ``data/<config>/train-
NNNNN-of-MMMMM.parquet``, one file per merged part (Parquet parts are linked; JSONL parts
are converted with the writers' storage rule, a column of mixed types as JSON text). The
upload is huggingface_hub's ``upload_folder``: it asks the Hub which files it already
has (preupload), so a killed upload, run again, sends only what it had not finished
(with hf_xet: files already committed are skipped and chunks deduplicated; without: the
LFS objects the Hub has are not sent again); its HTTP calls retry 429 and 5xx answers
with backoff, and an answered 429 or 5xx to the commit (which it does not retry: a lost
answer could commit twice) makes the whole upload go again, sending nothing the Hub has
(the transport's classification and backoff, mirageflow.transport.retry). The staged bytes are the same each time for the same records, which is
what lets the Hub recognise them. Files of ``data/`` the repo holds and this upload does
not (an earlier run's) are deleted in the same commit.

Refused before anything is sent: a run with shards not done (failed, running, missing,
stale) unless ``allow_partial`` (then the done shards are merged for the upload, the
card's figures are metrics.json's as ``mmirage stats`` computes them, the aggregate rule
having waited for every shard, and the card says which shards are left out); a run whose merged outputs or metrics are a previous
run's; a repo with files whose card names another pipeline, or no mirageflow pipeline,
unless ``overwrite_other``.

The token is huggingface_hub's own (``HF_TOKEN``, or the one ``hf auth login`` stored): it
is registered with the redaction (mirageflow.redact) before any request, so no log line
shows it, and nothing written (the record, the card, the staging folder) holds it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from mirageflow.config.types import PipelineConfig, PublishParams
from mirageflow.errors import MirageflowError
from mirageflow.files import atomic_write_json, atomic_write_text
from mirageflow.publish import card as cards
from mirageflow.state import layout as L

log = logging.getLogger(__name__)

REPO_TYPE = "dataset"
# the whole upload again after a transient answer huggingface_hub does not retry itself (the commit's)
UPLOAD_ATTEMPTS = 4
UPLOAD_RETRY_BASE_SECONDS = 1.0
UPLOAD_RETRY_MAX_SECONDS = 30.0


class PublishRefused(MirageflowError, RuntimeError):
    """The run or the repo is not one to publish (as asked); the message says what to do."""


class PublishFailed(MirageflowError, RuntimeError):
    """The Hub refused or failed the upload; the message is redacted (a server may echo the token)."""


def publish(cfg: PipelineConfig, config_file: str | os.PathLike, target: PublishParams) -> dict:
    """Stage and upload; returns the record written to ``<state_dir>/publish/published.json``."""
    from huggingface_hub import get_token

    from mirageflow.redact import register_secret

    register_secret(get_token())  # a token from `hf auth login` is in no variable the log filter knows
    paths = L.StateLayout(cfg.state_dir)
    left_out = _check_run(cfg, target)
    staging = paths.publish_staging
    inputs, files = _stage(cfg, config_file, staging, left_out)
    pid = cards.pipeline_id(cfg.state_dir)
    try:
        commit = _upload(staging, target, pid)
    except PublishRefused:
        raise
    except Exception as e:  # huggingface_hub's HTTP errors, and the RuntimeError it wraps an upload's in
        raise PublishFailed(_failure(e, target)) from None
    record = {
        "repo_id": target.repo_id,
        "revision": target.revision or "main",
        "commit": commit.oid,
        "commit_url": commit.commit_url,
        "private_requested": target.private,
        "partial": bool(left_out),
        "shards_left_out": left_out,
        "records": {name: inputs.records.get(ds.index) for ds, name in zip(cfg.datasets, cards.config_names(cfg))},
        "files": files,
    }
    atomic_write_json(paths.publish_record, record)
    log.info("published %s files to %s (revision %s, commit %s)", len(files), target.repo_id, record["revision"], commit.oid)
    return record


def _check_run(cfg: PipelineConfig, target: PublishParams) -> list[int]:
    """The shards left out (none unless allow_partial); refuses a run not fit to publish."""
    from mirageflow.state import pipeline as pipeline_state
    from mirageflow.state.shards import states_of

    states = states_of(cfg)
    not_done = {k: [s.shard_id for s in states if s.state == k] for k in ("failed", "running", "pending")}  # pending: stale too
    left_out = sorted({i for ids in not_done.values() for i in ids})
    if left_out and not target.allow_partial:
        what = "; ".join(f"{k}: {v[:20]}{' ...' if len(v) > 20 else ''}" for k, v in not_done.items() if v)
        raise PublishRefused(
            f"not every shard is done ({what}): rerun them (mmirage retry), or publish the done shards' records "
            "as a partial dataset with --allow-partial (execution_params.publish.allow_partial)"
        )
    if len(left_out) == cfg.num_shards:
        raise PublishRefused("no shard is done: nothing to publish")
    previous = None if left_out else pipeline_state.previous_results(cfg)  # a partial upload reads neither merged/ nor metrics.json
    if previous:
        raise PublishRefused(
            f"{', '.join(map(str, previous['outputs']))} are a previous run's ({previous['why']}): run the workflow "
            "until it finishes, so the records and the card are this run's"
        )
    return left_out


def _stage(cfg: PipelineConfig, config_file, staging: Path, left_out: list[int]) -> tuple[cards.CardInputs, list[str]]:
    """The repo's files in ``staging`` (made anew): the data as Parquet, and the card."""
    from mirageflow.data.dedup import DEDUP_SUBDIR
    from mirageflow.data.merge import merge_dataset

    paths = L.StateLayout(cfg.state_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if left_out:  # the done shards, merged for this upload
        # the aggregate rule has not run (it waits for every shard): its figures, as `mmirage stats` has them
        from mirageflow.report.aggregate import full_metrics
        from mirageflow.state.shards import current_fingerprint

        metrics = full_metrics(
            cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds, current_fingerprint(cfg), n_samples=cfg.n_samples
        )
        records = {}
        for ds in cfg.datasets:
            manifest = merge_dataset(cfg, ds, out=paths.partial_merge(ds.index), allow_missing=True)
            records[ds.index] = manifest["rows"]
        inputs = cards.CardInputs(metrics, records, {}, left_out)  # no dedup: it was made from another merge
        sources = {ds.index: paths.partial_merge(ds.index) for ds in cfg.datasets}
    else:
        inputs = cards.read_inputs(cfg)
        sources = {ds.index: L.merged_dir(ds.output_dir) for ds in cfg.datasets}
    files = []
    for ds, name in zip(cfg.datasets, cards.config_names(cfg)):
        files += _stage_parquet(sources[ds.index], ds.output_format, staging, name)
        if ds.index in inputs.dedup:
            files += _stage_parquet(Path(ds.output_dir) / DEDUP_SUBDIR, ds.output_format, staging, name + cards.DEDUP_SUFFIX)
    text = cards.render_card(cfg, config_file, inputs)
    if not left_out:  # the card beside merged/ is the one uploaded (rewritten only when it differs: its time is the rule's)
        for path in L.dataset_cards(cfg):
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                atomic_write_text(path, text)
    (staging / "README.md").write_text(text, encoding="utf-8")
    return inputs, ["README.md", *files]


def _stage_parquet(src: Path, fmt: str, staging: Path, name: str) -> list[str]:
    """``src``'s part files as ``data/<name>/train-NNNNN-of-MMMMM.parquet`` (linked, or converted from JSONL)."""
    parts = sorted(src.glob(f"part-*.{fmt}"))
    if not parts:
        raise PublishRefused(f"{src} holds no part-*.{fmt} file: run the workflow (merge) first")
    dest = staging / cards.data_dir(name)
    dest.mkdir(parents=True)
    names = [f"train-{i:05d}-of-{len(parts):05d}.parquet" for i in range(len(parts))]
    if fmt == "parquet":
        for part, file in zip(parts, names):
            try:
                os.link(part, dest / file)
            except OSError:
                shutil.copyfile(part, dest / file)
    else:
        _jsonl_to_parquet(parts, [dest / n for n in names])
    return [f"{cards.data_dir(name)}/{n}" for n in names]


def _jsonl_to_parquet(parts: list[Path], outs: list[Path]) -> None:
    """JSONL parts as Parquet files of one schema (the merge's: a column whose types cannot
    be unified without changing a value is JSON text)."""
    import pyarrow.parquet as pq

    from mirageflow.data.writers import ColumnNeedsJson, conform, plan_schema, read_jsonl_part, records_table

    tables = [records_table(read_jsonl_part(p)) for p in parts]
    as_json: set[str] = set()
    while True:
        schema = plan_schema([t.schema for t in tables], as_json)
        try:
            conformed = [conform(t, schema) for t in tables]
            break
        except ColumnNeedsJson as e:
            as_json.add(e.name)
    for table, out in zip(conformed, outs):
        pq.write_table(table, out)


# --------------------------------------------------------------------------- the Hub


def _upload(staging: Path, target: PublishParams, pid: str):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi()
    try:
        info = api.dataset_info(target.repo_id, revision=target.revision)
    except RepositoryNotFoundError:
        info = None
    except RevisionNotFoundError:  # a new branch: the repo's main says who made it
        info = api.dataset_info(target.repo_id)
    if info is not None and not target.overwrite_other:
        _check_owner(info, target, pid)
    api.create_repo(target.repo_id, repo_type=REPO_TYPE, private=target.private, exist_ok=True)
    if target.revision and target.revision != "main":
        api.create_branch(target.repo_id, repo_type=REPO_TYPE, branch=target.revision, exist_ok=True)
    for attempt in range(UPLOAD_ATTEMPTS):
        try:
            return api.upload_folder(
                repo_id=target.repo_id,
                repo_type=REPO_TYPE,
                folder_path=str(staging),
                revision=target.revision,
                commit_message="Upload the records and the dataset card (mirageflow)",
                delete_patterns=["data/*"],  # an earlier upload's files that this one does not hold
            )
        except Exception as e:
            delay = _transient(e, attempt)
            if delay is None:
                raise
            log.warning("the Hub answered %s: uploading again in %.1f s (what it has is not sent again)", _status(e), delay)
            time.sleep(delay)


def _status(error: BaseException | None) -> int | None:
    """The HTTP status huggingface_hub's error (or the error it wraps) carries."""
    while error is not None:
        response = getattr(error, "response", None)
        if response is not None and getattr(response, "status_code", None):
            return int(response.status_code)
        error = error.__cause__
    return None


def _transient(error: BaseException, attempt: int) -> float | None:
    """The wait before uploading again when the Hub's answer was transient (the transport's
    classification: 429, 5xx...), else None. huggingface_hub retries its calls itself, but
    not the commit (a lost answer could commit twice); an answered 429 committed nothing."""
    from mirageflow.transport.retry import TRANSIENT, backoff_delay, classify

    status = _status(error)
    if status is None or classify(status) != TRANSIENT or attempt + 1 >= UPLOAD_ATTEMPTS:
        return None
    return backoff_delay(attempt, UPLOAD_RETRY_BASE_SECONDS, UPLOAD_RETRY_MAX_SECONDS)


def _failure(error: BaseException, target: PublishParams) -> str:
    """What failed, with the causes huggingface_hub chained, redacted."""
    from mirageflow.redact import redact_text

    said, seen = [], error
    while seen is not None and len(said) < 4:
        said.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__
    return redact_text(
        f"the upload to {target.repo_id} failed: {' <- '.join(said)}. Run the same command again: the files the Hub "
        "already has are not sent again"
    )


def _check_owner(info, target: PublishParams, pid: str) -> None:
    """Refuse a repo with files whose card names another pipeline (or none)."""
    files = [s.rfilename for s in info.siblings or [] if s.rfilename != ".gitattributes"]
    if not files:
        return
    data = info.card_data.to_dict() if info.card_data is not None else {}
    theirs = (data.get("mirageflow") or {}).get("pipeline_id") if isinstance(data.get("mirageflow"), dict) else None
    if theirs == pid:
        return
    who = f"another mirageflow pipeline (pipeline_id {theirs})" if theirs else "no mirageflow pipeline (its card names none)"
    raise PublishRefused(
        f"{target.repo_id} holds {len(files)} file(s) made by {who}; this pipeline's id is {pid}. Publish to another "
        "repo, or replace its data and card with --overwrite-other (execution_params.publish.overwrite_other)"
    )
