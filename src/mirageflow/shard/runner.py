"""The shard job: rows -> variables -> prompts -> engine -> records -> writer, observed by stats.

``run_shard`` processes shard ``shard_id`` of every dataset in the config:

- Feeding: each row runs as a small coroutine through the outputs in order; up to
  ``max_inflight`` rows are in flight, so the engine always has work queued while Python
  reads, extracts and renders the next rows. There is no per-batch barrier.
- Checkpoints: finished rows are committed every ``checkpoint_rows`` rows (but not more
  often than every ``checkpoint_min_seconds``) or ``checkpoint_seconds`` seconds (see
  checkpoint.py); a rerun skips committed rows. During generation a writer thread makes
  them durable (part file, fsync, manifest) while the event loop goes on feeding the
  engine; while one commit is being written, the next one grows.
- Bad rows go to ``errors.jsonl`` and the shard goes on, within an error budget.
- SIGTERM/SIGINT: stop feeding, commit what is finished, stop the engine, record why in
  ``failure.json``, exit non-zero.
- ``status.json`` is written last, and only on success.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from mirageflow import gpu, json_output, stats
from mirageflow.checkpoint import Checkpoint, Lease, fingerprint
from mirageflow.config import PipelineConfig
from mirageflow.data.readers import ShardSlice, SourceRow, load_shard, read_shard, write_index
from mirageflow.data.writers import atomic_write_json
from mirageflow.engines.base import Completion, Engine, Request, create_engine
from mirageflow.progress import ProgressReporter
from mirageflow.prompts import Extractor, PromptBuilder, RecordRenderer, RowError

log = logging.getLogger(__name__)


def index_path(state_dir: str | Path, dataset_index: int) -> Path:
    return Path(state_dir) / "datasets" / f"dataset_{dataset_index}.index.json"


def index_datasets(cfg: PipelineConfig) -> None:
    """Index every dataset where the shards look for it: the index rule's work, for running
    shards without Snakemake (tests, benchmarks)."""
    for ds in cfg.datasets:
        write_index(ds, cfg.num_shards, index_path(cfg.state_dir, ds.index))


class ShardFailed(RuntimeError):
    pass


class ShardInterrupted(ShardFailed):
    def __init__(self, signum: int, rows_done: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {rows_done} rows committed, rerun to resume")


class _OutputStep:
    """Everything about one output variable that is fixed for the whole shard."""

    def __init__(self, output, processor, engine: Engine):
        self.output, self.processor, self.engine = output, processor, engine
        self.builder = PromptBuilder(output)
        self.sampling = {**processor.sampling_params, **output.sampling_params}
        self.schema_json = json.dumps(output.schema.json_schema()) if output.is_json else None
        self.validator = output.schema.validator() if output.is_json else None
        # OpenAI-compatible servers apply the chat template themselves.
        self.server_templates = getattr(engine, "templates_server_side", False)

    def request(self, rid: int, variables: dict) -> Request:
        messages = self.builder.messages(variables)
        prefix = self.output.response_prefix
        if not self.processor.apply_chat_template:
            prompt = messages[-1]["content"] + prefix
        elif self.server_templates:  # the engine sends the messages; the server continues the prefix
            prompt = None
            if prefix:
                messages.append({"role": "assistant", "content": prefix})
        else:
            try:
                prompt = self.engine.chat_prompt(messages, self.processor.chat_template_kwargs) + prefix
            except Exception as e:  # a template that rejects this row's messages
                raise RowError("render", "chat_template", f"chat template failed: {type(e).__name__}: {e}") from None
        return Request(rid, messages, prompt, self.sampling, self.schema_json)

    def value(self, c: Completion):
        if c.error_kind:
            raise RowError("generate", c.error_kind, c.error or c.error_kind)
        if c.finish_reason == "abort":
            raise RowError("generate", "aborted", "the engine aborted the request", raw=c.text)
        text = self.output.response_prefix + c.text
        if not self.output.is_json:
            return text
        try:
            return json_output.parse_answer(text, self.validator, truncated=c.finish_reason == "length")
        except json_output.OutputError as e:
            raise RowError("output", e.kind, f"output '{self.output.name}': {e}", raw=text) from None


class ShardRunner:
    def __init__(self, cfg: PipelineConfig, shard_id: int, engine_factory: Callable = create_engine):
        self.cfg, self.shard_id = cfg, shard_id
        self.params = cfg.shard
        self.engine_factory = engine_factory
        self.extract = Extractor(cfg.inputs)
        self.render = RecordRenderer(cfg.output_schema, cfg.remove_columns, [o.name for o in cfg.outputs])
        self.timer = stats.PhaseTimer()
        self.tracker = stats.InflightTracker()
        self.engines: dict[str, Engine] = {}
        self.shard_dir = cfg.shard_dir(shard_id)
        self.lease = Lease(self.shard_dir, self.params.lease_timeout_seconds)
        self.log_dir = Path(cfg.state_dir) / "logs" / f"shard_{shard_id}"  # engine server logs
        # counters for this attempt (the error budget and progress read these, not the
        # checkpoint, which the writer thread updates)
        self.computed = 0
        self.failed_now: Counter = Counter()
        self.ok_now = 0
        # committed by earlier attempts (set once the checkpoint is restored)
        self._resumed_ok = 0
        self._resumed_failed: Counter = Counter()
        self.input_tokens = self.output_tokens = self.requests = 0
        self.resumed = 0
        self.interrupted: int | None = None
        self.abort: BaseException | None = None
        self.checkpoint: Checkpoint | None = None
        self._pending: dict[int, tuple[list, list]] = {}
        self._pending_rows = 0
        self._rate_applies = False  # once it does, a successful row cannot break the budget
        self._last_commit = time.monotonic()
        self._stopping: asyncio.Event | None = None  # set to stop feeding rows (_halt)
        self._writer: ThreadPoolExecutor | None = None  # commits during generation
        self._writing: asyncio.Future | None = None  # the commit being written
        # observers: GPU sampling (stats: true), live progress.json, tokens per row
        self.sampler = gpu.GpuSampler(self.params.gpu_sample_interval_seconds, sample=cfg.stats)
        self.live: ProgressReporter | None = None
        self.tokens_per_row = stats.TokenHistogram()
        self.attempt = 1

    # ------------------------------------------------------------------ setup

    def _load_slices(self) -> list[ShardSlice]:
        """Where this shard's rows are in each dataset (from the index rule's output)."""
        slices = []
        for ds in self.cfg.datasets:
            try:
                slices.append(load_shard(index_path(self.cfg.state_dir, ds.index), ds, self.cfg.num_shards, self.shard_id))
            except (OSError, ValueError) as e:
                raise ShardFailed(str(e)) from e
        return slices

    def _totals(self) -> tuple[int, int]:
        """Rows done and failed so far: committed before, and finished in this attempt."""
        return self._resumed_ok + self.ok_now, sum(self._resumed_failed.values()) + sum(self.failed_now.values())

    # ------------------------------------------------------------------ one row

    async def _row(self, row: SourceRow, steps: list[_OutputStep]) -> dict:
        """The row's record; raises RowError for a row that cannot be completed."""
        if isinstance(row.value, RowError):
            raise row.value
        variables = self.extract(row.value)
        row_tokens = None
        try:
            for step in steps:
                request = step.request(row.index, variables)
                self.tracker.submitted()
                try:
                    completion = await step.engine.generate_one(request)
                finally:
                    self.tracker.completed()
                self.requests += 1
                self.input_tokens += completion.prompt_tokens
                self.output_tokens += completion.completion_tokens
                row_tokens = (row_tokens or 0) + completion.completion_tokens
                variables[step.output.name] = step.value(completion)
        finally:
            if row_tokens is not None:
                self.tokens_per_row.add(row_tokens)
        return self.render(row.index, row.value, variables)

    def _finished(self, ds_index: int, row: SourceRow, record: dict | None, exc: RowError | None, progress) -> None:
        """Book one finished row: its record, or its RowError; commit every checkpoint_rows."""
        records, errors = self._pending.setdefault(ds_index, ([], []))
        if exc is None:
            records.append(record)
            self.ok_now += 1
        else:
            entry = {"dataset": ds_index, "source_index": row.index, "stage": exc.stage, "error": exc.kind, "message": str(exc)}
            if exc.raw is not None:
                entry["raw"] = exc.raw
            errors.append(entry)
            self.failed_now[exc.kind] += 1
        self.computed += 1
        self._pending_rows += 1
        progress.update(1)
        if exc is not None or not self._rate_applies:
            self._check_budget(final=False)
        if self._pending_rows >= self.params.checkpoint_rows and self._commit_allowed():
            self._commit_soon()

    def _commit_allowed(self) -> bool:
        return time.monotonic() - self._last_commit >= self.params.checkpoint_min_seconds

    def _halt(self, exc: BaseException | None = None) -> None:
        """Stop feeding rows: the shard failed (exc) or was interrupted; rows in flight are cancelled."""
        if exc is not None and self.abort is None:
            self.abort = exc
        if self._stopping is not None:
            self._stopping.set()

    def _check_budget(self, final: bool) -> None:
        done, failed = self._totals()
        total = done + failed
        p = self.params
        too_many = p.max_errors is not None and failed > p.max_errors
        rate_applies = total >= p.min_rows_for_error_rate or (final and total > 0)
        self._rate_applies = self._rate_applies or (rate_applies and not final)
        too_often = rate_applies and failed / total > p.max_error_rate
        all_failed = final and failed and not done  # never a silent empty output
        if (too_many or too_often or all_failed) and self.abort is None:
            classes = ", ".join(f"{k}: {v}" for k, v in self._failed_classes().most_common())
            what = "every row of" if all_failed else "error budget exceeded in"
            self._halt(ShardFailed(
                f"{what} shard {self.shard_id}: {failed} of {total} rows failed ({classes}); "
                f"max_error_rate {p.max_error_rate}, max_errors {p.max_errors}; see {self.shard_dir / 'errors.jsonl'}"
            ))

    def _failed_classes(self) -> Counter:
        return self._resumed_failed + self.failed_now

    def _take_pending(self) -> dict[int, tuple[list, list]]:
        batch = {k: v for k, v in self._pending.items() if v[0] or v[1]}
        self._pending = {}
        self._pending_rows = 0
        self._last_commit = time.monotonic()
        return batch

    def _write(self, batch: dict[int, tuple[list, list]]) -> None:
        """Make a batch of finished rows durable and renew the lease (one thread at a time)."""
        with self.timer.phase("write"):
            for ds_index, (records, errors) in batch.items():
                try:
                    self.checkpoint.commit(ds_index, records, errors)
                except OSError as e:  # disk full, quota, read-only output
                    raise ShardFailed(
                        f"cannot commit finished rows of shard {self.shard_id}: {e}; the rows committed "
                        "before are intact and a rerun resumes from them"
                    ) from e
            self.lease.heartbeat()

    def _commit(self) -> None:
        """Commit everything finished, now, in this thread (outside the event loop)."""
        self._write(self._take_pending())

    def _commit_soon(self) -> None:
        """On the event loop: hand what is finished to the writer thread, unless it is still
        writing the last batch (then the rows wait for the next call and the batch grows)."""
        if self._writing is not None and not self._writing.done():
            return
        self._writing = asyncio.get_running_loop().run_in_executor(self._writer, self._write, self._take_pending())
        self._writing.add_done_callback(self._written)

    def _written(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:  # disk full, lost lease
            self._halt(future.exception())

    async def _ticker(self) -> None:
        """Commits on time even when rows trickle in, and keeps the lease alive."""
        period = min(self.params.checkpoint_seconds, self.params.lease_timeout_seconds / 4)
        while True:
            await asyncio.sleep(min(period, 1.0))
            if time.monotonic() - self._last_commit >= period or (
                self._pending_rows >= self.params.checkpoint_rows and self._commit_allowed()
            ):
                self._commit_soon()

    # ------------------------------------------------------------------ the shard

    def _rows(self, slices: list[ShardSlice]):
        """(dataset index, row) for every row still to do, dataset after dataset, in source order."""
        for ds, piece in zip(self.cfg.datasets, slices):
            yield from ((ds.index, row) for row in read_shard(ds, piece, skip=self.checkpoint.committed_before(ds.index)))

    async def _worker(self, rows, steps, progress) -> None:
        """Take the next row, run it through every output, book it; until no row is left.

        ``window`` workers share one row iterator, so that many rows are in flight and a
        finished row makes room for the next one at once, with no barrier between rows or
        between datasets. Cheaper per row than a task per row.
        """
        for ds_index, row in rows:
            if self.abort or self.interrupted:
                return
            try:
                record = await self._row(row, steps)
            except RowError as e:
                self._finished(ds_index, row, None, e, progress)
            except Exception as e:  # engine crash, lost lease...: the shard cannot go on
                self._halt(e)
                return
            else:
                self._finished(ds_index, row, record, None, progress)

    async def _feed(self, slices: list[ShardSlice], steps, window: int, progress) -> None:
        rows = self._rows(slices)
        workers = [asyncio.create_task(self._worker(rows, steps, progress)) for _ in range(window)]
        everything = asyncio.gather(*workers)
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([everything, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:  # stopped, or done: cancelling the gather cancels the workers still running
            everything.cancel()
            stopping.cancel()
            await asyncio.gather(everything, stopping, return_exceptions=True)

    async def _run_async(self, slices: list[ShardSlice], steps) -> None:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            log.warning("received %s: committing finished rows and stopping", signal.Signals(signum).name)
            self.interrupted = signum
            for engine in self.engines.values():
                engine.stop()
            main.cancel()
            self._halt()

        main = asyncio.current_task()
        installed = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, on_signal, signum)
                installed.append(signum)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        self._stopping = asyncio.Event()
        ticker = asyncio.create_task(self._ticker())
        window = self.params.max_inflight or min(e.max_inflight for e in self.engines.values())
        total = sum(piece.stop - piece.start for piece in slices)
        progress = tqdm(total=total, initial=self.resumed, desc=f"shard {self.shard_id}", unit="row", file=sys.stderr, mininterval=2.0)
        try:
            await self._feed(slices, steps, window, progress)
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
        finally:
            ticker.cancel()
            if self._writing is not None:  # the last batch handed over: written before the loop ends
                await asyncio.gather(self._writing, return_exceptions=True)
            progress.close()
            for signum in installed:
                loop.remove_signal_handler(signum)

    def run(self) -> list[dict]:
        cfg = self.cfg
        slices = self._load_slices()
        ranges = {ds.index: (piece.start, piece.stop) for ds, piece in zip(cfg.datasets, slices)}
        self.lease.acquire()
        previous = self._interrupt_on_signals()
        try:
            self._start_progress(sum(stop - start for start, stop in ranges.values()))
            self.checkpoint = Checkpoint(
                self.shard_dir,
                fingerprint(cfg, ranges),
                {ds.index: (Path(ds.output_dir) / f"shard_{self.shard_id}", ds.output_format) for ds in cfg.datasets},
            )
            self.checkpoint.restore(retry_failed=cfg.retry_failed_rows)
            self.resumed = self.checkpoint.resumed_rows()
            self._resumed_ok = sum(len(p.done) for p in self.checkpoint.datasets.values())
            self._resumed_failed = self.checkpoint.failed_classes()
            if self.resumed:
                log.info("resuming shard %d: %d rows already committed are skipped", self.shard_id, self.resumed)

            self.live.set_phase("loading")
            with self.timer.phase("load"):
                for name in {o.processor for o in cfg.outputs}:
                    engine = self.engine_factory(cfg.processors[name], cfg.batch_size, log_dir=self.log_dir)
                    if self.params.max_inflight:  # engines size their pools at load
                        engine.max_inflight = self.params.max_inflight
                    self.engines[name] = engine
                    engine.load()
                gc.collect()  # what loading left behind, once (counted as load: ~0.3 s with transformers)
            warmups = [e.warmup for e in self.engines.values() if callable(getattr(e, "warmup", None))]
            if warmups:  # engines that warm up (compile, capture graphs) before serving
                self.live.set_phase("warmup")
                with self.timer.phase("warmup"):
                    for warmup in warmups:
                        warmup()
            steps = [_OutputStep(o, cfg.processors[o.processor], self.engines[o.processor]) for o in cfg.outputs]

            self.live.set_phase("generating")
            self.sampler.start()
            # Take what is alive now (model, libraries: ~400k objects with transformers) out of
            # the cyclic GC's view: a full collection during generation would walk them all
            # (0.3 s each on a 2-core machine) while the event loop, and so the engine, waits.
            gc.freeze()
            self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"shard{self.shard_id}-writer")
            try:
                with self.timer.phase("generate"):
                    asyncio.run(self._run_async(slices, steps))
            finally:
                self._writer.shutdown(wait=True)
                gc.unfreeze()
                self.sampler.stop()
                self._write_gpu_samples()
            self.live.set_phase("writing")
            self._interrupt_on_signals()  # the loop reset them to the defaults
            self._commit()  # whatever finished, also when interrupted
            if self.interrupted:
                raise ShardInterrupted(self.interrupted, sum(self._totals()))
            if self.abort:
                raise self.abort
            self._check_budget(final=True)
            if self.abort:
                raise self.abort
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.lease.release()

        per_dataset = []
        for ds, (start, stop) in ((ds, ranges[ds.index]) for ds in cfg.datasets):
            prog = self.checkpoint.datasets[ds.index]
            per_dataset.append({
                "path": ds.path,
                "output_dir": str(prog.out_dir),
                "row_range": [start, stop],
                "rows_processed": len(prog.done),
                "rows_failed": len(prog.failed),
                "parts": prog.parts,
            })  # fmt: skip
        return per_dataset

    def _interrupt_on_signals(self) -> dict:
        """Before and after the event loop (engine load, final commit) a signal still ends the shard cleanly."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            for engine in self.engines.values():
                engine.stop()
            raise ShardInterrupted(signum, sum(self._totals()) if self.checkpoint else 0)

        return {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}

    # ------------------------------------------------------------------ observers

    def _start_progress(self, rows_total: int) -> None:
        def snapshot() -> dict:
            depths = [e.queue_depth() for e in list(self.engines.values())]
            depths = [d for d in depths if d is not None]
            return {
                "rows_done": self.resumed + self.computed,
                "rows_failed": sum(self.failed_now.values()),
                "output_tokens": self.output_tokens,
                "queue_depth": sum(depths) if depths else None,
                "inflight": self.tracker.inflight,
            }

        self.live = ProgressReporter(
            self.shard_dir / "progress.json", self.shard_id, rows_total, snapshot, attempt=self.attempt, num_gpus=stats.allocated_gpus()
        )
        self.live.start()

    def finish_progress(self, phase: str) -> None:
        if self.live is not None:
            self.live.finish(phase)
            self.live = None

    def _write_gpu_samples(self) -> None:
        timeline = self.sampler.timeline_json()
        if timeline is not None:
            try:
                atomic_write_json(self.shard_dir / "gpu_samples.json", {"shard_id": self.shard_id, **timeline})
            except OSError as e:  # the samples are for plots; the shard's records matter more
                log.warning("cannot write gpu_samples.json: %s", e)

    def hardware(self) -> dict:
        return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), **self.sampler.hardware()}

    def model_facts(self) -> dict:
        """Weight and KV-cache bytes of each processor's local model dir (for the roofline); null when unknown."""
        return {name: stats.model_memory_facts(p.server_args.get("model_path")) for name, p in self.cfg.processors.items()}

    def close(self) -> None:
        for engine in self.engines.values():
            try:
                engine.close()
            except Exception:  # closing must not hide the shard's own error
                log.exception("closing engine failed")

    def stats(self, runtime: float) -> dict:
        phases = self.timer.seconds
        num_gpus = stats.allocated_gpus()
        window = self.tracker.window_seconds
        done, failed = self._totals() if self.checkpoint else (0, 0)
        gpus = self.sampler.summary()
        return {
            "runtime_seconds": runtime,
            "runtime_human": stats.human_duration(runtime),
            "model_load_seconds": phases.get("load", 0.0),
            "warmup_seconds": phases.get("warmup", 0.0),
            "generation_seconds": phases.get("generate", 0.0),
            "inference_runtime_seconds": window,
            "write_seconds": phases.get("write", 0.0),
            **self.tracker.summary(),
            "rows_processed": done,
            "rows_failed": failed,
            "rows_failed_by_class": dict(self._failed_classes()) if self.checkpoint else {},
            "rows_resumed": self.resumed,
            "rows_computed": self.computed,
            "requests": self.requests,
            "throughput_rows_per_sec": self.computed / runtime if runtime > 0 else None,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "num_gpus": num_gpus,
            **stats.rate_figures(self.output_tokens, window, num_gpus),
            **stats.wall_rate_figures(self.output_tokens, runtime, num_gpus),
            "gpu_seconds_allocated": num_gpus * runtime,
            **gpus,
            "joules_per_1k_output_tokens": stats.joules_per_1k_tokens(gpus["gpu_energy_joules"], self.output_tokens),
            **self._roofline(stats.tokens_per_sec_per_gpu(self.output_tokens, window, num_gpus)),
            "output_tokens_per_row_hist": self.tokens_per_row.to_json(),
        }

    def _roofline(self, tokens_per_sec_per_gpu: float | None) -> dict:
        """Decode roofline of the shard's model on its GPUs (one processor, one GPU model), else nulls."""
        names = {g["name"] for g in self.sampler.hardware()["gpus"]}
        procs = list(self.cfg.processors.values())
        model = stats.model_memory_facts(procs[0].server_args.get("model_path")) if len(procs) == 1 else None
        batch = None
        if procs and self.tracker.peak:
            args = procs[0].server_args
            batch = self.tracker.peak / (args.get("dp_size") or 1)  # sequences per replica
            cap = (args.get("extra_engine_args") or {}).get("max_running_requests")
            batch = min(batch, cap) if cap else batch
        return stats.roofline_figures(
            model, names.pop() if len(names) == 1 else None, self.tracker.peak, self.input_tokens, self.output_tokens,
            self.requests, tokens_per_sec_per_gpu, sequences_per_gpu=batch,
        )  # fmt: skip


def run_shard(cfg: PipelineConfig, shard_id: int, attempt: int = 1, engine_factory: Callable = create_engine) -> dict:
    """Run one shard; write status.json on success, failure.json (and raise) on failure."""
    shard_dir = cfg.shard_dir(shard_id)
    shard_dir.mkdir(parents=True, exist_ok=True)
    started_at, t0 = stats.utc_now(), time.monotonic()
    base = {
        "shard_id": shard_id,
        "num_shards": cfg.num_shards,
        "attempt": attempt,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "started_at": started_at,
    }
    runner = ShardRunner(cfg, shard_id, engine_factory)
    runner.attempt = attempt
    try:
        per_dataset = runner.run()
    except BaseException as e:
        runner.finish_progress("failed")
        failure = {
            **base,
            "status": "failed",
            "finished_at": stats.utc_now(),
            "error": f"{type(e).__name__}: {e}",
            "signal": signal.Signals(e.signum).name if isinstance(e, ShardInterrupted) else None,
            "traceback": traceback.format_exc(),
            "hardware": runner.hardware(),
            "stats": runner.stats(time.monotonic() - t0),
        }
        atomic_write_json(shard_dir / "failure.json", failure)
        raise
    finally:
        runner.close()
    status = {
        **base,
        "status": "success",
        "finished_at": stats.utc_now(),
        "error": None,
        "engines": {name: vars(e.info) for name, e in runner.engines.items()},
        "hardware": runner.hardware(),
        "model": runner.model_facts(),
        "datasets": per_dataset,
        "stats": runner.stats(time.monotonic() - t0),
    }
    (shard_dir / "failure.json").unlink(missing_ok=True)
    atomic_write_json(shard_dir / "status.json", status)
    runner.finish_progress("done")
    st = status["stats"]
    log.info(
        "shard %d done: %d rows ok, %d failed (%d resumed), %d output tokens",
        shard_id, st["rows_processed"], st["rows_failed"], st["rows_resumed"], st["output_tokens"],
    )  # fmt: skip
    return status
