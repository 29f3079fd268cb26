"""The shard job: rows -> variables -> prompts -> engine -> records -> writer, observed by stats.

One call of ``run_shard`` processes shard ``shard_id`` of every dataset in the config and
writes ``<state_dir>/shard_<id>/status.json`` as its very last act. A bad row is written to
``errors.jsonl`` and the shard goes on; a shard in which every row failed is a failure,
never a silent empty output.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from mirageflow import json_output, stats
from mirageflow.config import PipelineConfig
from mirageflow.data.readers import SourceRow, read_shard
from mirageflow.data.writers import ShardWriter, atomic_write_json
from mirageflow.engines.base import Completion, Engine, Request, create_engine
from mirageflow.prompts import Extractor, PromptBuilder, RecordRenderer, RowError

log = logging.getLogger(__name__)

CHUNK_ROWS = 512  # rows taken through all outputs at a time; bounds memory and batches well


def index_path(state_dir: str | Path, dataset_index: int) -> Path:
    return Path(state_dir) / "datasets" / f"dataset_{dataset_index}.index.json"


class ShardFailed(RuntimeError):
    pass


@dataclass
class Counters:
    rows_ok: int = 0
    failed: Counter = field(default_factory=Counter)
    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0

    @property
    def rows_failed(self) -> int:
        return sum(self.failed.values())


class _ErrorLog:
    """errors.jsonl: one line per failed row, with the stage, class and message."""

    def __init__(self, path: Path):
        self._f = open(path, "w", buffering=1)

    def write(self, dataset: int, source_index: int, err: RowError) -> None:
        entry = {"dataset": dataset, "source_index": source_index, "stage": err.stage, "error": err.kind, "message": str(err)}
        if err.raw is not None:
            entry["raw"] = err.raw
        self._f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._f.close()


class _OutputStep:
    """Everything about one output variable that is fixed for the whole shard."""

    def __init__(self, output, processor, engine: Engine):
        self.output, self.processor, self.engine = output, processor, engine
        self.builder = PromptBuilder(output)
        self.sampling = {**processor.sampling_params, **output.sampling_params}
        self.schema_json = json.dumps(output.schema.json_schema()) if output.is_json else None
        self.validator = output.schema.validator() if output.is_json else None

    def request(self, rid: int, variables: dict) -> Request:
        messages = self.builder.messages(variables)
        if self.processor.apply_chat_template:
            try:
                prompt = self.engine.chat_prompt(messages, self.processor.chat_template_kwargs)
            except Exception as e:  # a template that rejects this row's messages
                raise RowError("render", "chat_template", f"chat template failed: {type(e).__name__}: {e}") from None
        else:
            prompt = messages[-1]["content"]
        return Request(rid, messages, prompt + self.output.response_prefix, self.sampling, self.schema_json)

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
        self.engine_factory = engine_factory
        self.extract = Extractor(cfg.inputs)
        self.render = RecordRenderer(cfg.output_schema, cfg.remove_columns, [o.name for o in cfg.outputs])
        self.timer = stats.PhaseTimer()
        self.counters = Counters()
        self.engines: dict[str, Engine] = {}

    # ------------------------------------------------------------------ per chunk

    def _process_chunk(self, ds_index: int, rows: list[SourceRow], steps, writer: ShardWriter, errors: _ErrorLog) -> None:
        live: dict[int, tuple[SourceRow, dict]] = {}
        for pos, row in enumerate(rows):
            try:
                if isinstance(row.value, RowError):
                    raise row.value
                live[pos] = (row, self.extract(row.value))
            except RowError as e:
                self._fail(errors, ds_index, row.index, e)

        for step in steps:
            requests = []
            for pos, (row, variables) in list(live.items()):
                try:
                    requests.append(step.request(pos, variables))
                except RowError as e:
                    self._fail(errors, ds_index, row.index, e)
                    del live[pos]
            with self.timer.phase("generate"):
                completions = list(step.engine.generate(requests))
            for c in completions:
                self.counters.requests += 1
                self.counters.input_tokens += c.prompt_tokens
                self.counters.output_tokens += c.completion_tokens
                row, variables = live[c.id]
                try:
                    variables[step.output.name] = step.value(c)
                except RowError as e:
                    self._fail(errors, ds_index, row.index, e)
                    del live[c.id]

        with self.timer.phase("write"):
            for pos in sorted(live):
                row, variables = live[pos]
                try:
                    record = self.render(row.index, row.value, variables)
                except RowError as e:
                    self._fail(errors, ds_index, row.index, e)
                    continue
                writer.add(record)
                self.counters.rows_ok += 1

    def _fail(self, errors: _ErrorLog, ds_index: int, source_index: int, err: RowError) -> None:
        self.counters.failed[err.kind] += 1
        errors.write(ds_index, source_index, err)

    # ------------------------------------------------------------------ whole shard

    def run(self) -> list[dict]:
        cfg = self.cfg
        indices = []
        for ds in cfg.datasets:
            with open(index_path(cfg.state_dir, ds.index)) as f:
                index = json.load(f)
            if index["num_shards"] != cfg.num_shards or index["path"] != ds.path:
                raise ShardFailed(f"{index_path(cfg.state_dir, ds.index)} was built for another config; rerun its index rule")
            indices.append(index)
        total = sum(ix["shards"][self.shard_id]["stop"] - ix["shards"][self.shard_id]["start"] for ix in indices)

        with self.timer.phase("load"):
            for name in {o.processor for o in cfg.outputs}:
                engine = self.engine_factory(cfg.processors[name], cfg.batch_size)
                engine.load()
                self.engines[name] = engine
        steps = [_OutputStep(o, cfg.processors[o.processor], self.engines[o.processor]) for o in cfg.outputs]

        shard_dir = cfg.shard_dir(self.shard_id)
        errors = _ErrorLog(shard_dir / "errors.jsonl")
        per_dataset = []
        progress = tqdm(total=total, desc=f"shard {self.shard_id}", unit="row", file=sys.stderr, mininterval=2.0)
        try:
            for ds, index in zip(cfg.datasets, indices):
                before = (self.counters.rows_ok, self.counters.rows_failed)
                out_dir = Path(ds.output_dir) / f"shard_{self.shard_id}"
                writer = ShardWriter(out_dir, ds.output_format)
                rows: Iterator[SourceRow] = read_shard(ds, index, self.shard_id)
                while chunk := list(islice(rows, CHUNK_ROWS)):
                    self._process_chunk(ds.index, chunk, steps, writer, errors)
                    progress.update(len(chunk))
                with self.timer.phase("write"):
                    writer.flush()
                shard = index["shards"][self.shard_id]
                per_dataset.append({
                    "path": ds.path,
                    "output_dir": str(out_dir),
                    "row_range": [shard["start"], shard["stop"]],
                    "rows_processed": self.counters.rows_ok - before[0],
                    "rows_failed": self.counters.rows_failed - before[1],
                })  # fmt: skip
        finally:
            progress.close()
            errors.close()
        if self.counters.rows_failed and not self.counters.rows_ok:
            classes = ", ".join(f"{k}: {v}" for k, v in self.counters.failed.most_common())
            raise ShardFailed(
                f"every row of shard {self.shard_id} failed ({classes}); see {shard_dir / 'errors.jsonl'}"
            )
        return per_dataset

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    def stats(self, runtime: float) -> dict:
        c, phases = self.counters, self.timer.seconds
        num_gpus = stats.allocated_gpus()
        inference = phases.get("generate", 0.0)
        rows = c.rows_ok
        return {
            "runtime_seconds": runtime,
            "runtime_human": stats.human_duration(runtime),
            "model_load_seconds": phases.get("load", 0.0),
            "inference_runtime_seconds": inference,
            "write_seconds": phases.get("write", 0.0),
            "other_seconds": max(0.0, runtime - sum(phases.values())),
            "rows_processed": rows,
            "rows_failed": c.rows_failed,
            "rows_failed_by_class": dict(c.failed),
            "requests": c.requests,
            "throughput_rows_per_sec": rows / runtime if runtime > 0 else None,
            "input_tokens": c.input_tokens,
            "output_tokens": c.output_tokens,
            "num_gpus": num_gpus,
            **stats.rate_figures(c.output_tokens, inference, num_gpus),
            "gpu_seconds_allocated": num_gpus * runtime,
            # GPU sampling (stats: true) lands with NVML support; null until then.
            "gpu_util_mean": None,
            "gpu_util_min": None,
            "gpu_util_max": None,
            "gpu_util_samples": None,
        }


def run_shard(cfg: PipelineConfig, shard_id: int, attempt: int = 1, engine_factory: Callable = create_engine) -> dict:
    """Run one shard; write status.json on success, failure.json (and raise) on failure."""
    import time

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
    try:
        per_dataset = runner.run()
    except BaseException as e:
        failure = {
            **base,
            "status": "failed",
            "finished_at": stats.utc_now(),
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
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
        "datasets": per_dataset,
        "stats": runner.stats(time.monotonic() - t0),
    }
    (shard_dir / "failure.json").unlink(missing_ok=True)
    atomic_write_json(shard_dir / "status.json", status)
    log.info(
        "shard %d done: %d rows ok, %d failed, %d output tokens",
        shard_id, status["stats"]["rows_processed"], status["stats"]["rows_failed"], status["stats"]["output_tokens"],
    )  # fmt: skip
    return status
