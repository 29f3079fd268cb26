"""The shard job: rows -> variables -> prompts -> engine -> records -> writer, observed by stats.

``run_shard`` processes shard ``shard_id`` of every dataset in the config. ``ShardRunner``
keeps the setup (restore, steps) and the attempt's end; its collaborators each own
one concern: ``ShardEngines`` (shard/shard_engines.py: the engines, image generators and
custom steps' pools: loaded, warmed up, stopped, closed), ``RowFeeder``
(shard/row_feeder.py: the worker coroutines that feed the pending rows and book each
finished one), ``RowPath`` (a row, or a row's samples, through the steps),
``ErrorBudget`` (row outcomes, when the shard fails),
``CommitQueue`` (pending batches, the writer thread, the ticker), ``ShardMetrics`` (phases,
tokens, GPUs, sums over attempts), ``StopSignals`` (SIGTERM/SIGINT), ``Checkpoint`` and
``Lease`` (state on disk).

- Feeding: ``window`` worker coroutines share one row iterator, so up to ``max_inflight``
  rows are in flight and the engine always has work queued; no barrier between rows.
- Every row ends as a record or a row error in ``errors.jsonl``; an exception on the row
  path that is not the engine's becomes a row error too (class ``internal_error``), and a
  dataset that cannot be read fails the shard naming the file. The shard succeeds only
  when, for every dataset, committed records + row errors cover its row range exactly.
- No model for no work: rows all committed load no engine; with answers in the request
  cache, rows are fed first without engines (shard/cached_answers.py) and the engines are
  loaded only when a request's answer is not kept.
- SIGTERM/SIGINT: stop feeding, commit what is finished, stop the engine, record why in
  ``failure.json``, exit non-zero.
- ``status.json`` is written last, and only on success.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import traceback
from pathlib import Path
from typing import Callable

from mirageflow.stats import formulas as stats
from mirageflow.shard.checkpoint import Checkpoint, Lease, data_identity, fingerprint
from mirageflow.shard import cached_answers, request_cache
from mirageflow.config import PipelineConfig
from mirageflow.data.readers import ShardSlice, content_digest, load_shard, write_index
from mirageflow.files import atomic_write_json
from mirageflow.engines.base import Engine, death_class_of
from mirageflow.engines.registry import create_engine
from mirageflow.shard.progress import ProgressReporter
from mirageflow.prompts.images import RowImages
from mirageflow.prompts.templates import Extractor, RecordRenderer, columns_read
from mirageflow.redact import redact_text
from mirageflow.shard.accounting import check_accounting, check_images
from mirageflow.shard.budget import ErrorBudget
from mirageflow.shard.commits import CommitQueue
from mirageflow.shard.failures import ShardFailed, ShardInterrupted
from mirageflow.shard import feed
from mirageflow.shard.metrics import ShardMetrics
from mirageflow.shard.row_feeder import RowFeeder
from mirageflow.shard.shard_engines import ShardEngines
from mirageflow.shard.rows import RowPath
from mirageflow.shard.signals import StopSignals
from mirageflow.shard.steps import python as python_steps
from mirageflow.shard.steps.image import ImageStep, ShardImages
from mirageflow.shard.steps.llm import LLMStep
from mirageflow.state import layout as L
from mirageflow.state.inputs import ContentCache, ImageRecorder, images_changed
from mirageflow.state.layout import StateLayout, shard_output_dir

log = logging.getLogger(__name__)


def index_path(state_dir: str | Path, dataset_index: int) -> Path:
    return StateLayout(state_dir).dataset_index(dataset_index)


def index_datasets(cfg: PipelineConfig) -> None:
    """Index every dataset where the shards look for it: the index rule's work, for running
    shards without Snakemake (tests, benchmarks)."""
    for ds in cfg.datasets:
        write_index(ds, cfg.num_shards, index_path(cfg.state_dir, ds.index))


class ShardRunner:
    def __init__(
        self, cfg: PipelineConfig, shard_id: int, attempt: int = 1, engine_factory: Callable = create_engine,
        row_limit: int | None = None,
    ):  # fmt: skip
        self.cfg, self.shard_id, self.params = cfg, shard_id, cfg.shard
        self.row_limit = row_limit  # only the shard's first rows, over its datasets in order (the canary)
        paths = StateLayout(cfg.state_dir)
        self.shard_dir = paths.shard_dir(shard_id)
        self.lease = Lease(self.shard_dir, self.params.lease_timeout_seconds)
        self.metrics = ShardMetrics(cfg, attempt)
        self.n = cfg.n_samples  # records per row; above 1 the unit of work is a sample (mirageflow/shard/samples.py)
        self.shard_engines = ShardEngines(cfg, shard_id, engine_factory, paths.shard_server_logs(shard_id), self.metrics, self.n)
        render = RecordRenderer(
            cfg.output_schema, cfg.remove_columns, [o.name for o in cfg.outputs if o.kind != "filter"], cfg.preserve_columns,
            [f"{o.name}_{k}" for o in cfg.outputs if o.kind == "image_gen" for k in ("path", "seed")],
        )  # fmt: skip
        # image inputs (VLMs): RowImages is false without any
        self.rows = RowPath(Extractor(cfg.inputs), RowImages.from_config(cfg), render, self.metrics, self.n)
        self.columns = columns_read(cfg.inputs, cfg.remove_columns, cfg.preserve_columns)  # what a Parquet shard decodes
        self.budget = ErrorBudget(self.params, shard_id, paths.errors(shard_id))
        self.checkpoint: Checkpoint | None = None
        self.cache: request_cache.RequestCache | None = None
        self.commits: CommitQueue | None = None
        self.signals: StopSignals | None = None
        self.live: ProgressReporter | None = None
        self.resumed = 0  # units (samples; rows when n_samples is 1) committed before this attempt
        self.resumed_rows = 0  # source rows whose every sample was committed before this attempt
        self.feeder = RowFeeder(cfg, shard_id, self.rows, self.budget, self.metrics, self.columns)

    @property
    def engines(self) -> dict[str, Engine]:
        """The LLM engines by processor (empty until loaded)."""
        return self.shard_engines.engines

    @property
    def image_gens(self) -> dict:
        """The image generators by processor (empty until loaded)."""
        return self.shard_engines.image_gens

    # ------------------------------------------------------------------ setup

    def _restore(self, slices: list[ShardSlice]) -> None:
        ranges = {ds.index: (piece.start, piece.stop) for ds, piece in zip(self.cfg.datasets, slices)}
        outputs = {ds.index: (shard_output_dir(ds.output_dir, self.shard_id), ds.output_format) for ds in self.cfg.datasets}
        data = {ds.index: self._data_identity(ds) for ds in self.cfg.datasets}
        self.checkpoint = cp = Checkpoint(self.shard_dir, fingerprint(self.cfg, ranges, data), outputs, self.n)
        # rows made from image files that changed since are made again (state/inputs.py)
        cache = ContentCache(StateLayout(self.cfg.state_dir).content_cache)  # the driver's hashes, read only
        changed = images_changed(self.shard_dir, cache) if self.rows.images else None
        if changed:
            log.warning("shard %d starts over: %s", self.shard_id, changed)
        cp.restore(retry_failed=self.cfg.retry_failed_rows, start_over=bool(changed))
        if self.rows.images:  # the image files it reads, by content: an edit of one reruns this shard
            self.rows.images.recorder = ImageRecorder(self.shard_dir, fresh=cp.committed_units() == 0)
        self.metrics.begin_attempt(cp)
        if self.params.request_cache:
            self.cache = request_cache.RequestCache(self.shard_dir, lookups=not self.cfg.fresh_answers)
            try:
                self.cache.restore()
            except OSError as e:
                raise ShardFailed(
                    f"the request cache {self.cache.dir} cannot be used: {type(e).__name__}: {e}; make it writable "
                    "(or remove it), or turn the cache off with shard_params.request_cache: false"
                ) from e
            self.rows.cache = self.cache
        self.live.attempt = self.metrics.attempt  # the shard's own attempt number, now that the earlier ones are known
        self.resumed, self.resumed_rows = cp.committed_units(), cp.complete_rows()
        self.budget.resume(
            sum(len(p.done) for p in cp.datasets.values()), cp.failed_classes(), sum(len(p.filtered) for p in cp.datasets.values())
        )  # fmt: skip
        self.commits = CommitQueue(
            cp, self.lease, self.params, self.metrics.timer, self.shard_id, lambda: self.metrics.save_attempt(self.budget.computed), self.cache
        )  # fmt: skip
        self.commits.on_failure = self.feeder.halt
        self.feeder.begin(cp, self.commits)
        if self.resumed:
            log.info("resuming shard %d: %s already committed are skipped", self.shard_id, cp.describe_committed())

    def _data_identity(self, ds) -> list | str | None:
        """The dataset's content as its index saw it (part of the checkpoint's fingerprint):
        the digest of its files' SHA-256 (every size), or, for an index from before those,
        the file fingerprint's sizes and hashes."""
        try:
            header = json.loads(index_path(self.cfg.state_dir, ds.index).read_text())
            return content_digest(header) or data_identity(header["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # load_shard read it a moment ago
            raise ShardFailed(f"cannot read the index of dataset {ds.index}: {e}") from e

    # ------------------------------------------------------------------ the shard

    def run(self) -> list[dict]:
        slices = []
        for ds in self.cfg.datasets:  # where this shard's rows are (the index rule's output)
            try:
                slices.append(load_shard(index_path(self.cfg.state_dir, ds.index), ds, self.cfg.num_shards, self.shard_id))
            except (OSError, ValueError) as e:
                raise ShardFailed(str(e)) from e
        if self.row_limit is not None:
            slices = feed.first_rows(slices, self.row_limit)
        self.lease.acquire()
        try:
            try:
                with StopSignals(self.shard_engines.stop, self._interrupted) as self.signals:
                    self._run(slices)
            except BaseException as e:
                stopped = self._stopped_by_signal(e)
                if stopped is None:
                    raise
                raise stopped from e
            self._finish_attempt("success")
        except BaseException as e:
            self._finish_attempt("interrupted" if isinstance(e, ShardInterrupted) else "failed", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.lease.release()
        return check_accounting(self.cfg, self.checkpoint, slices, self.shard_id)

    def _run(self, slices: list[ShardSlice]) -> None:
        self._start_progress(sum(piece.stop - piece.start for piece in slices))  # source rows
        self._restore(slices)
        images = self._shard_images(slices)
        if self.resumed < self.live.rows_total * self.n:
            self._generate_rows(slices, images)
        else:  # every unit committed before (a rerun after the last commit): no engine to load for no work
            log.info("shard %d: all %s were committed before; no engine is loaded", self.shard_id, self.checkpoint.describe_committed())
        check_accounting(self.cfg, self.checkpoint, slices, self.shard_id)
        if any(o.kind == "image_gen" for o in self.cfg.outputs):
            check_images(self.cfg, self.checkpoint, images, self.shard_id)
        verdict = self.budget.final()
        if verdict:
            raise verdict

    def _generate_rows(self, slices: list[ShardSlice], images: ShardImages) -> None:
        """Run the rows still to do through the engines; committed when it returns. With answers
        in the request cache, the rows are fed first without engines (shard/cached_answers.py):
        the engines are loaded only when a request's answer is not kept."""
        stand_ins = cached_answers.stand_ins(self.cfg, self.cache)
        if stand_ins is not None:
            if not self._feed(slices, images, stand_ins):
                log.info("shard %d: every answer came from the request cache; no engine is loaded", self.shard_id)
                return
            log.info("shard %d: a request's answer is not in the request cache; loading the engines", self.shard_id)
        self.shard_engines.load(self.checkpoint, self.live, stopping=lambda: bool(self.signals and self.signals.signum))
        self._feed(slices, images, self.engines)

    def _feed(self, slices: list[ShardSlice], images: ShardImages, engines: dict[str, Engine]) -> bool:
        """Run the rows still to do through the steps of ``engines``; what finished is committed
        when it returns. True: stopped at a request the cache-only stand-ins cannot answer
        (``AnswerNotCached``), the rows it did not finish still to do."""
        loaded = engines is self.engines  # else the stand-ins: no model, no GPU to sample
        steps = [
            python_steps.make_step(o, lambda o: self._model_step(o, images, engines), self.shard_engines.pools) for o in self.cfg.outputs
        ]
        if self.cache is not None:
            identities = self.shard_engines.cache_identities(engines)
            for step in steps:
                if step.calls_engine:
                    step.use_cache(identities[step.output.processor])
        self.rows.set_steps(steps, cache_only=not loaded)
        self.live.set_phase("generating")
        if loaded:
            self.metrics.sampler.start()
        # Take what is alive now (model, libraries: ~400k objects with transformers) out of
        # the cyclic GC's view: a full collection during generation would walk them all
        # (0.3 s each on a 2-core machine) while the event loop, and so the engine, waits.
        gc.freeze()
        try:
            with self.metrics.timer.phase("generate"):
                self.feeder.feed(slices, steps, engines, self.image_gens, self.signals)
        finally:
            self.commits.stop()
            gc.unfreeze()
            if loaded:
                self.metrics.sampler.stop()
                self.metrics.write_gpu_samples(self.shard_dir, self.shard_id)
        self.live.set_phase("writing")
        self.commits.flush()  # whatever finished, also when interrupted
        if self.signals.signum:
            raise self._interrupted(self.signals.signum)
        if isinstance(self.feeder.abort, cached_answers.AnswerNotCached) and not loaded:
            self.feeder.abort = None
            self.feeder.skip_committed()  # what this pass committed is skipped by the next one
            return True
        if self.feeder.abort:
            raise self.feeder.abort
        return False

    def _model_step(self, output, images: ShardImages, engines: dict[str, Engine]):
        """The step of an output a processor computes: an LLM's (or a batch API's), or an image's."""
        if output.kind == "image_gen":
            inputs = [v.name for v in self.cfg.inputs]
            return ImageStep(output, self.cfg.image_processors[output.processor], self.image_gens[output.processor], images, inputs)
        return LLMStep(output, self.cfg.processors[output.processor], engines[output.processor])

    def _shard_images(self, slices: list[ShardSlice]) -> ShardImages:
        starts, before = {}, 0
        for ds, piece in zip(self.cfg.datasets, slices):
            starts[ds.index] = (piece.start, before)
            before += (piece.stop - piece.start) * self.n
        out_dirs = {ds.index: Path(ds.output_dir) for ds in self.cfg.datasets}
        return ShardImages(self.shard_id, starts, out_dirs, self.n, self.checkpoint.images)

    def _stopped_by_signal(self, error: BaseException) -> ShardInterrupted | None:
        """The shard's end when a SIGTERM/SIGINT came, whatever exception it surfaced as: the
        signal's exception raised inside a library is often caught and wrapped there (an
        import in transformers' lazy modules becomes "ModuleNotFoundError: Could not import
        module 'AutoModelForCausalLM'"), so the signal received decides, not the class."""
        if isinstance(error, ShardInterrupted):
            return None
        signum = self.signals.signum if self.signals is not None else None
        if not signum:
            return None
        log.info("stopped by %s while %s", signal.Signals(signum).name, f"{type(error).__name__}: {error}")
        return self._interrupted(signum)

    def _interrupted(self, signum: int) -> ShardInterrupted:
        """The shard's end on SIGTERM/SIGINT, saying what is committed as the resume will ("N rows")."""
        if self.checkpoint is None:
            return ShardInterrupted(signum, "nothing")
        return ShardInterrupted(signum, self.checkpoint.describe_committed())

    # ------------------------------------------------------------------ attempts, observers

    def _finish_attempt(self, outcome: str, error: str | None = None) -> None:
        """Keep this attempt's counters with the checkpoint. When the shard already failed,
        a failure to save (a full disk) is logged and the shard's own error goes on."""
        if self.checkpoint is None or self.metrics.checkpoint is None:  # stopped before the attempt began
            return
        self.metrics.save_attempt(self.budget.computed, outcome, error)
        if outcome == "success":
            self.checkpoint.save()
            return
        try:
            self.checkpoint.save()
        except Exception:
            log.exception("cannot save the counters of this failed attempt in %s", self.checkpoint.path)

    def _start_progress(self, rows_total: int) -> None:
        self.live = ProgressReporter(
            self.shard_dir / L.PROGRESS, self.shard_id, rows_total, lambda: _progress_snapshot(self),
            attempt=self.metrics.attempt, num_gpus=self.metrics.num_gpus, n_samples=self.n,
        )  # fmt: skip
        self.live.start()

    def finish_progress(self, phase: str) -> None:
        if self.live is not None:
            self.live.finish(phase)
            self.live = None

    def close(self) -> None:
        recorder = getattr(self.rows.images, "recorder", None)
        if recorder is not None:
            recorder.close()
        self.shard_engines.close()

    def stats(self) -> dict:
        # what the request cache holds now, for the docs' size figures
        cache = None if self.cache is None else {"answers_kept": len(self.cache), "bytes": self.cache.disk_bytes()}
        return self.metrics.stats(self.budget, self.resumed, request_cache=cache)


def _progress_snapshot(runner: ShardRunner) -> dict:
    """What progress.json shows of a running shard (called by the reporter's thread)."""
    depths = [d for d in (e.queue_depth() for e in list(runner.engines.values())) if d is not None]
    samples = runner.resumed + runner.budget.computed
    cp = runner.checkpoint
    return {
        "samples_done": samples,  # finished: committed, or handed to the writer
        "rows_done": samples if runner.n == 1 else runner.resumed_rows + runner.feeder.rows_finished,
        "samples_committed": cp.committed_units() if cp is not None else None,
        "rows_failed": sum(runner.budget.failed_now.values()),
        "output_tokens": runner.metrics.output_tokens,
        "queue_depth": sum(depths) if depths else None,
        "inflight": runner.metrics.tracker.inflight,
        "engine_restarts": sum(e.restarts() for e in list(runner.metrics.engines.values())),
        # dollars of every attempt so far, and the tokens no price is known for (stats/pricing.py)
        **dict(zip(("cost_usd", "unpriced_tokens"), runner.metrics.spend_so_far())),
    }


def run_shard(
    cfg: PipelineConfig, shard_id: int, attempt: int = 1, engine_factory: Callable = create_engine, row_limit: int | None = None
) -> dict:
    """Run one shard; write status.json on success, failure.json (and raise) on failure.

    Both record the records fingerprint they were made under (``records_fingerprint``): a
    status.json of an earlier config is stale, not done (mirageflow.state.shards)."""
    from mirageflow.state.shards import job_fingerprint

    paths = StateLayout(cfg.state_dir)
    shard_dir = paths.shard_dir(shard_id)
    shard_dir.mkdir(parents=True, exist_ok=True)
    runner = ShardRunner(cfg, shard_id, attempt, engine_factory, row_limit)
    base = {
        "shard_id": shard_id,
        "num_shards": cfg.num_shards,
        "records_fingerprint": job_fingerprint(cfg),
        "attempt": attempt,  # Snakemake's, until the checkpoint tells the shard's own number
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "started_at": runner.metrics.started_at,
    }
    try:
        per_dataset = runner.run()
    except BaseException as e:
        runner.finish_progress("failed")
        failure = {
            **base,
            "attempt": runner.metrics.attempt,
            "status": "failed",
            "finished_at": stats.utc_now(),
            "error": redact_text(f"{type(e).__name__}: {e}"),
            "signal": signal.Signals(e.signum).name if isinstance(e, ShardInterrupted) else None,
            # why the engine died the last time, when that ended the shard, or budget_exceeded (an EngineDeathClass)
            "failure_class": death_class_of(e),
            # what a rerun keeps ("3 rows"), for the run summary of an interrupted run
            "committed": runner.checkpoint.describe_committed() if runner.checkpoint is not None else "nothing",
            "traceback": redact_text(traceback.format_exc()),
            "hardware": runner.metrics.hardware(),
            "stats": runner.stats(),
        }
        try:
            atomic_write_json(paths.failure(shard_id), failure)
        except OSError as write_error:  # a full disk: the log keeps the record
            log.error("shard %d failed (%s) and its failure.json cannot be written: %s", shard_id, failure["error"], write_error)
        raise
    finally:
        runner.close()
    status = {
        **base,
        "attempt": runner.metrics.attempt,
        "status": "success",
        "finished_at": stats.utc_now(),
        "error": None,
        "engines": {
            **{name: vars(e.info) for name, e in runner.engines.items()},
            **{name: g.info for name, g in runner.image_gens.items()},
        },
        # the inference servers' own figures (their /metrics) beside our counters; null without
        "server_metrics": runner.metrics.server_figures(runner.engines),
        "hardware": runner.metrics.hardware(),
        "model": runner.metrics.model_facts(),
        "datasets": per_dataset,
        "stats": runner.stats(),
    }
    paths.failure(shard_id).unlink(missing_ok=True)
    atomic_write_json(paths.status(shard_id), status)
    runner.finish_progress("done")
    st = status["stats"]
    log.info(
        "shard %d done: %d rows ok, %d failed (%d resumed; %d attempts), %d output tokens",
        shard_id, st["rows_processed"], st["rows_failed"], st["rows_resumed"], len(st["attempts"]), st["output_tokens"],
    )  # fmt: skip
    return status
