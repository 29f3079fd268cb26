"""Where everything of a pipeline lives in its state directory (and beside its outputs).

The one place that spells these paths: the shard job, the rules (workflow/rules/*.smk),
the CLI, the report and the terminal all ask a ``StateLayout`` (a test checks that the
rules' paths are these). Each id argument takes an int or a Snakemake wildcard
(``"{shard}"``), so a rule's pattern and a job's file come from the same method::

    <state_dir>/
      configs/<sha256 prefix>.json       the config every job's command line names (state/pipeline.py)
      owner.json                         which pipeline (its output_dirs, its config) this state_dir is
      records.fingerprint                what can change a record; the shards depend on it
      datasets/dataset_<k>.index.json    a dataset's row count and where each shard starts
      datasets/dataset_<k>.offsets.bin   (its per-shard table)
      datasets/content.json              content identity of input files by stat identity (state/inputs.py)
      shard_<i>/status.json              written last, only on success (the shard rule's output)
      shard_<i>/failure.json             why the last attempt failed
      shard_<i>/progress.json            live progress of a running shard
      shard_<i>/lease.json               who runs the shard now (heartbeats)
      shard_<i>/checkpoint.json          committed parts and the attempts' counters
      shard_<i>/errors.jsonl             failed rows
      shard_<i>/gpu_samples.json         the GPU timeline (stats: true)
      shard_<i>/batches.json, batches/   provider batches submitted, their requests and results (batch_api)
      shard_<i>/images.jsonl             images written, with size and SHA-256 (image_gen)
      shard_<i>/input_images.jsonl       the image files it read, by content (state/inputs.py)
      shard_<i>/damaged/, orphaned/      part files set aside at resume
      hub_models/<slug>.json             a Hugging Face model the driver downloaded (hub_model rule)
      engines/engine_<g>.json            an engine service's endpoint (shards_per_engine > 1)
      rate_limits/<processor>.json       the pace the shards share under a processor's limits (transport/rate_limit.py)
      engines/engine_<g>.stats.json      its loads
      merged/dataset_<k>.json            the merge manifest
      dedup/dataset_<k>.json, .removed.jsonl   deduplication counts and removed records
      dedup/dataset_<k>/                 the dedup stages' signatures, edges, decisions, written parts' reports (data/dedup_stages.py)
      metrics.json, summary.md, report.html    the aggregate
      publish/pipeline_id.json           this pipeline's id, written in its dataset card (publish/card.py)
      publish/published.json             the last upload to the Hugging Face Hub (mmirage publish, rule publish)
      publish/staging/, publish/merged_<k>/   the folder uploaded, and a partial merge made for it
      canary/verdict.json                the canary's verdict, which every shard waits for (canary_rows)
      canary/state/, canary/out/         the canary shard's own state_dir and output (shard/canary.py)
      logs/<job>.log, logs/attempts/     every job's log (the latest attempt, and all of them)
      logs/shard_<i>/, logs/engine_<g>/  engine server logs

    <output_dir>/shard_<i>/part-*.*      a shard's committed records
    <output_dir>/merged/                 all records in source order
    <output_dir>/README.md               the dataset card (rule card; what mmirage publish uploads)
    <output_dir>/images/                 image_gen's files (the ledger's paths are relative to <output_dir>)
    <output_dir>/.mirageflow-owner.json  which pipeline writes there
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the jobs import this module before anything heavy (their signal handlers)
    from mirageflow.config.types import PipelineConfig

Id = int | str  # a number, or a Snakemake wildcard such as "{shard}"

# the files of a shard's state directory, by the name the report and warnings use
STATUS = "status.json"
FAILURE = "failure.json"
PROGRESS = "progress.json"
LEASE = "lease.json"
CHECKPOINT = "checkpoint.json"
ERRORS = "errors.jsonl"
GPU_SAMPLES = "gpu_samples.json"
BATCH_LEDGER = "batches.json"  # shard/ledger.py: a batch_api shard's provider batches
BATCH_SPOOL = "batches"  # their requests (<key>.jsonl) and results (<key>.results.jsonl)
IMAGE_LEDGER = "images.jsonl"  # shard/ledger.py: an image_gen shard's images written
IMAGE_RECORDS = "input_images.jsonl"  # state/inputs.py: the image inputs a shard read, by content
CONTENT_CACHE = "content.json"  # in datasets/
FINGERPRINT = "records.fingerprint"
PREVIOUS_RESULTS = "previous_results.json"
CONFIGS = "configs"
LOGS = "logs"
ATTEMPT_LOGS = "attempts"
OWNER = ".mirageflow-owner.json"
HUB_MODELS = "hub_models"
MERGED = "merged"
IMAGES = "images"  # image_gen's default folder in a dataset's output_dir


class StateLayout:
    """The paths of one pipeline's state directory (``cfg.state_dir``), relative or absolute as given."""

    def __init__(self, state_dir: str | os.PathLike):
        self.root = Path(state_dir)

    def __repr__(self) -> str:
        return f"StateLayout({str(self.root)!r})"

    # ------------------------------------------------------------------ the pipeline's files

    @property
    def configs_dir(self) -> Path:
        return self.root / CONFIGS

    @property
    def fingerprint(self) -> Path:
        return self.root / FINGERPRINT

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.md"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def previous_results(self) -> Path:
        """Which derived outputs (report, merged/) are a previous run's, kept until replaced (state/pipeline.py)."""
        return self.root / PREVIOUS_RESULTS

    def dataset_index(self, ds: Id) -> Path:
        return self.root / "datasets" / f"dataset_{ds}.index.json"

    def dataset_offsets(self, ds: Id) -> Path:
        return self.root / "datasets" / f"dataset_{ds}.offsets.bin"

    @property
    def content_cache(self) -> Path:
        return self.root / "datasets" / CONTENT_CACHE

    def dataset_indices(self) -> list[Path]:
        """The index files present now (one per dataset once the index jobs ran)."""
        return sorted((self.root / "datasets").glob("dataset_*.index.json"), key=lambda p: (len(p.name), p.name))

    def merge_manifest(self, ds: Id) -> Path:
        return self.root / MERGED / f"dataset_{ds}.json"

    def dedup_counts(self, ds: Id) -> Path:
        return self.root / "dedup" / f"dataset_{ds}.json"

    def dedup_removed(self, ds: Id) -> Path:
        return self.root / "dedup" / f"dataset_{ds}.removed.jsonl"

    def dedup_work(self, ds: Id) -> Path:
        """The dedup stages' files of a dataset (data/dedup_stages.py)."""
        return self.root / "dedup" / f"dataset_{ds}"

    def dedup_signatures(self, ds: Id, job: Id) -> dict[str, Path]:
        """Stage 1 job ``job``'s files: meta (json, written last), sig (MinHash signatures, one
        row each), bands (band entries by partition), classes (class entries by partition)."""
        d = self.dedup_work(ds)
        return {kind: d / f"signatures_{job}.{kind}.{'json' if kind == 'meta' else 'npy'}" for kind in ("meta", "sig", "bands", "classes")}

    def dedup_edges(self, ds: Id, partition: Id) -> Path:
        """Stage 2 partition ``partition``'s duplicate edges."""
        return self.dedup_work(ds) / f"edges_{partition}.npy"

    def dedup_decisions(self, ds: Id) -> Path:
        """Stage 3's decisions: the removed rows and what each duplicates."""
        return self.dedup_work(ds) / "decisions.npy"

    def dedup_written(self, ds: Id, job: Id) -> Path:
        """Stage 4 job ``job``'s report of the deduplicated parts it wrote."""
        return self.dedup_work(ds) / f"written_{job}.json"

    def dedup_count_files(self) -> list[Path]:
        """The dedup counts present now, by dataset number."""
        return sorted((self.root / "dedup").glob("dataset_*.json"), key=lambda p: (len(p.name), p.name))

    def hub_model_marker(self, slug: Id) -> Path:
        """The hub_model rule's record of a downloaded Hugging Face model (mirageflow/hub_models.py)."""
        return self.root / HUB_MODELS / f"{slug}.json"

    def engine_endpoint(self, group: Id) -> Path:
        return self.root / "engines" / f"engine_{group}.json"

    def engine_stats(self, group: Id) -> Path:
        return self.root / "engines" / f"engine_{group}.stats.json"

    @property
    def spend(self) -> Path:
        """The run's spend ledger under execution_params.max_cost_usd (transport/spend.py; locked per request)."""
        return self.root / "spend.json"

    def rate_limits(self, processor: str) -> Path:
        """The pace every shard of a processor with max_requests/tokens_per_minute shares (locked per request)."""
        return self.root / "rate_limits" / f"{processor}.json"

    def engine_stats_files(self) -> list[Path]:
        return sorted((self.root / "engines").glob("engine_*.stats.json"))

    # ------------------------------------------------------------------ publishing (mirageflow/publish)

    @property
    def publish_dir(self) -> Path:
        return self.root / "publish"

    @property
    def pipeline_id(self) -> Path:
        """The id the dataset card carries: a repo whose card has another is another pipeline's."""
        return self.publish_dir / "pipeline_id.json"

    @property
    def publish_record(self) -> Path:
        """The last upload (the publish rule's output): repo, revision, commit, files; never the token."""
        return self.publish_dir / "published.json"

    @property
    def publish_staging(self) -> Path:
        """The folder uploaded: the card and the data as Parquet, laid out as in the repo."""
        return self.publish_dir / "staging"

    def partial_merge(self, ds: Id) -> Path:
        """The done shards of a dataset merged for a partial upload (--allow-partial)."""
        return self.publish_dir / f"merged_{ds}"

    # ------------------------------------------------------------------ the canary (execution_params.canary_rows)

    @property
    def canary_dir(self) -> Path:
        return self.root / "canary"

    @property
    def canary_verdict(self) -> Path:
        """Written only when the canary passed: the input every shard waits for."""
        return self.canary_dir / "verdict.json"

    @property
    def canary_failed(self) -> Path:
        """The verdict of a canary that failed (not a rule output: Snakemake would delete it)."""
        return self.canary_dir / "failed.json"

    @property
    def canary_state(self) -> Path:
        """The canary shard's own state_dir (its index copies, shard_0/, fingerprint)."""
        return self.canary_dir / "state"

    @property
    def canary_output(self) -> Path:
        return self.canary_dir / "out"

    # ------------------------------------------------------------------ logs

    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS

    def log(self, job: str) -> Path:
        """A job's log (the rule's ``log:``): ``shard_3``, ``index_dataset_0``, ``aggregate``..."""
        return self.root / LOGS / f"{job}.log"

    def shard_log(self, shard: Id) -> Path:
        return self.log(f"shard_{shard}")

    def engine_log(self, group: Id) -> Path:
        return self.log(f"engine_{group}")

    def shard_server_logs(self, shard: Id) -> Path:
        """Where a shard's own engines keep their server logs."""
        return self.root / LOGS / f"shard_{shard}"

    def engine_server_logs(self, group: Id) -> Path:
        """Where an engine service's engines keep their server logs."""
        return self.root / LOGS / f"engine_{group}"

    # ------------------------------------------------------------------ one shard

    def shard_dir(self, shard: Id) -> Path:
        return self.root / f"shard_{shard}"

    def status(self, shard: Id) -> Path:
        return self.shard_dir(shard) / STATUS

    def failure(self, shard: Id) -> Path:
        return self.shard_dir(shard) / FAILURE

    def progress(self, shard: Id) -> Path:
        return self.shard_dir(shard) / PROGRESS

    def lease(self, shard: Id) -> Path:
        return self.shard_dir(shard) / LEASE

    def checkpoint(self, shard: Id) -> Path:
        return self.shard_dir(shard) / CHECKPOINT

    def errors(self, shard: Id) -> Path:
        return self.shard_dir(shard) / ERRORS

    def gpu_samples(self, shard: Id) -> Path:
        return self.shard_dir(shard) / GPU_SAMPLES

    def batch_ledger(self, shard: Id) -> Path:
        return self.shard_dir(shard) / BATCH_LEDGER

    def batch_spool(self, shard: Id) -> Path:
        return self.shard_dir(shard) / BATCH_SPOOL

    def image_ledger(self, shard: Id) -> Path:
        return self.shard_dir(shard) / IMAGE_LEDGER

    def image_records(self, shard: Id) -> Path:
        return self.shard_dir(shard) / IMAGE_RECORDS

    def status_files(self, num_shards: int) -> list[str]:
        """Every shard's status.json, as the aggregate and merge rules take them."""
        return [str(self.status(i)) for i in range(num_shards)]


def default_targets(cfg: PipelineConfig) -> list[str]:
    """What the workflow's default target (rule all) builds from the shards: the report, each
    dataset's merge manifest and card (execution_params.merge), dedup counts
    (deduplication_params) and the upload (execution_params.publish)."""
    paths = StateLayout(cfg.state_dir)
    targets = [str(paths.metrics), str(paths.summary)]
    if cfg.merge:
        targets += [str(paths.merge_manifest(ds.index)) for ds in cfg.datasets]
    if cfg.dedup is not None:
        targets += [str(paths.dedup_counts(ds.index)) for ds in cfg.datasets]
    if cfg.merge:
        targets += [str(p) for p in dataset_cards(cfg)]
    if cfg.execution.publish is not None:
        targets.append(str(paths.publish_record))
    return targets


# --------------------------------------------------------------------------- beside the outputs


def shard_output_dir(output_dir: str | os.PathLike, shard: Id) -> Path:
    """Where a shard commits a dataset's part files."""
    return Path(output_dir) / f"shard_{shard}"


def images_dir(output_dir: str | os.PathLike) -> Path:
    """Where an image_gen output writes its files by default (``processors[].output_dir`` unset)."""
    return Path(output_dir) / IMAGES


def image_file(output_dir: str | os.PathLike, relative: str) -> Path:
    """The file of an image the image ledger (``images.jsonl``) or a record names: its
    ``path`` is relative to the dataset's output_dir, never to the shard's part folder."""
    return Path(output_dir) / relative


def image_relative(output_dir: str | os.PathLike, file: str | os.PathLike) -> str:
    """An image file's path as the ledger and the record keep it (``image_file``'s inverse)."""
    return os.path.relpath(file, output_dir)


def merged_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / MERGED


def dataset_card(output_dir: str | os.PathLike) -> Path:
    """The dataset card beside merged/ (the same card in every output_dir of the pipeline)."""
    return Path(output_dir) / "README.md"


def dataset_cards(cfg: PipelineConfig) -> list[Path]:
    """The card of each output_dir of the pipeline, once each."""
    return [dataset_card(d) for d in dict.fromkeys(ds.output_dir for ds in cfg.datasets)]


STATE_OWNER = "owner.json"


def state_owner_marker(state_dir: str | os.PathLike) -> Path:
    """The pipeline a state_dir belongs to (state/pipeline.py: check_state_owner)."""
    return Path(state_dir) / STATE_OWNER


def owner_marker(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / OWNER


def state_dir_of_config_file(path: str | os.PathLike) -> Path | None:
    """The state_dir a workflow-written config file lives in (``<state_dir>/configs/x.json``), else None."""
    p = Path(path)
    return p.parent.parent if p.parent.name == CONFIGS else None
