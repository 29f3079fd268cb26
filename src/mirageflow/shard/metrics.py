"""What a shard measures: phases, engine occupancy, tokens, requests, GPUs, and the sums
over its attempts.

Each attempt's counters are kept in the checkpoint (``attempt_entry``, saved with every
commit), so a shard resumed after a crash, a time limit or a failed budget reports the
work of all its attempts: rows, tokens, requests, GPU-seconds and phase times add up, and
its tokens/s divides all output tokens by all generation time. These count work done,
lost work included. What the records hold (their answers and tokens, cached ones told
apart, the tokens histogram) is counted with the records instead: ``record_*`` and
``output_tokens_per_row_hist``, the sum of the committed parts' tallies (shard/tally.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from mirageflow.config.types import PipelineConfig
from mirageflow.stats import gpu, pricing
from mirageflow.stats import formulas as stats
from mirageflow.files import atomic_write_json
from mirageflow.redact import redact_text
from mirageflow.shard.tally import RecordTally, UnitTally
from mirageflow.state.records import STATS_SUMMED

log = logging.getLogger(__name__)


class ShardMetrics:
    def __init__(self, cfg: PipelineConfig, attempt: int):
        self.cfg = cfg
        # the shard's own attempt number (1, 2, ... over every run of the workflow, counted in
        # the checkpoint); Snakemake's retry number of this job restarts at 1 in each run
        self.attempt = attempt
        self.snakemake_attempt = attempt
        self.started_at, self.t0 = stats.utc_now(), time.monotonic()
        self.timer = stats.PhaseTimer()
        self.tracker = stats.InflightTracker()
        self.input_tokens = self.output_tokens = self.requests = 0
        # input tokens with a request's prompt counted once per choice: what vLLM's counter
        # counts for a request with n (native_n); equal to input_tokens otherwise
        self.input_tokens_each_choice = 0
        # this attempt's tokens per processor (to set beside each engine's server counters)
        self.by_processor: dict[str, dict[str, int]] = {}
        # images sent (one per placeholder, counted per request) and the prompt tokens they
        # became where the engine tells (transformers, SGLang); part of input_tokens
        self.images = self.image_tokens = 0
        # answers taken from the request cache (not sent; their tokens are not this run's work)
        self.requests_cached = 0
        # every answer the engine or the cache gave, those cut by the length limit, those of
        # JSON outputs: the quality counters of the canary and the report's findings
        self.answers = self.answers_length_cut = self.json_answers = 0
        # (dataset, row, sample) -> the tally of a record rendered and not yet booked (shard/tally.py)
        self._rendered: dict[tuple, UnitTally] = {}
        self.sampler = gpu.GpuSampler(cfg.shard.gpu_sample_interval_seconds, sample=cfg.stats)
        # an engine across N nodes holds this node's GPUs on each of them (the job asks SLURM for the same
        # gres per node): tokens/s per GPU, GPU-hours and the roofline count every GPU of every node.
        # NVML samples (gpus, gpu_util_mean, energy) are this node's only: the engine's details say so.
        self.num_gpus = stats.allocated_gpus() * cfg.execution.nodes
        self.checkpoint = None  # where the attempts are kept, once restored
        self.index = 0  # this attempt's place in checkpoint.attempts
        # the loaded engines and image generators, by processor: their launched servers' restarts and deaths
        # (engine_restarts, engine_deaths)
        self.engines: dict = {}
        # dollars of the answers' tokens at each processor's price (None: unknown), and of the GPU-hours
        self.prices = {name: pricing.processor_price(p) for name, p in cfg.processors.items()}
        self.gpu_hour_usd = pricing.gpu_hour_usd(cfg.processors.values())
        self.token_cost_usd, self.unpriced_tokens = 0.0, 0

    def book(
        self, request, completion, sent: bool = True, cached: bool = False, processor: str | None = None, choice_prompt: int | None = None
    ) -> None:
        """Count one answer: its tokens, and the request and its images when ``sent`` (the
        second and later choices of one request with n were not sent again). ``cached``:
        taken from the request cache, counted as an answer but not as tokens or a request.
        ``processor``: whose tokens these are (set beside its server's counters).
        ``choice_prompt``: the prompt tokens of the request this answer is a choice of (a
        request with n books them with its first choice only)."""
        if completion.error_kind is None:
            self.answers += 1
            if completion.finish_reason == "length":
                self.answers_length_cut += 1
            if request.json_schema is not None:  # a JSON output's
                self.json_answers += 1
        if cached:
            self.requests_cached += 1
            return
        self.input_tokens += completion.prompt_tokens
        self.output_tokens += completion.completion_tokens
        each_choice = completion.prompt_tokens if choice_prompt is None else choice_prompt
        self.input_tokens_each_choice += each_choice
        if processor is not None:
            mine = self.by_processor.get(processor)
            if mine is None:
                mine = self.by_processor[processor] = {"input_tokens": 0, "output_tokens": 0, "input_tokens_each_choice": 0}
            mine["input_tokens"] += completion.prompt_tokens
            mine["output_tokens"] += completion.completion_tokens
            mine["input_tokens_each_choice"] += each_choice
        price = self.prices.get(processor) if processor is not None else None
        if price is not None:
            self.token_cost_usd += price.cost(completion.prompt_tokens, completion.completion_tokens, completion.cached_tokens)
        elif processor in self.prices:
            self.unpriced_tokens += completion.prompt_tokens + completion.completion_tokens
        if sent:
            self.requests += 1
            if request.images:
                self.images += len(request.images)
        if request.images:
            self.image_tokens += completion.image_tokens or 0

    def cost_usd(self, runtime: float | None = None) -> float:
        """This attempt's dollars: its answers' tokens, and its GPU-hours at gpu_hour_usd."""
        runtime = self.runtime() if runtime is None else runtime
        return self.token_cost_usd + (self.num_gpus * runtime / 3600 * self.gpu_hour_usd if self.gpu_hour_usd else 0.0)

    def spend_so_far(self) -> tuple[float, int]:
        """(dollars, unpriced tokens) of every attempt: the earlier ones' from the checkpoint, and this one's now."""
        earlier = [a for i, a in enumerate(self.checkpoint.attempts) if i != self.index] if self.checkpoint is not None else []
        return (
            sum(a.get("cost_usd") or 0.0 for a in earlier) + self.cost_usd(),
            sum(a.get("unpriced_tokens") or 0 for a in earlier) + self.unpriced_tokens,
        )

    def unbook_cached(self, tally: UnitTally) -> None:
        """Take back ``book``'s counts of a unit's answers, all from the request cache, that
        the cache-only pass (shard/cached_answers.py) left unfinished: it is fed again."""
        self.answers -= tally.answers
        self.answers_length_cut -= tally.length_cut
        self.json_answers -= tally.json_answers
        self.requests_cached -= tally.llm_steps

    def rendered(self, ds_index: int, row_index: int, sample: int | None, tally: UnitTally) -> None:
        """A record was rendered: its tally waits for the runner to commit the record with it (``take_tally``)."""
        self._rendered[ds_index, row_index, sample] = tally

    def take_tally(self, ds_index: int, row_index: int, sample: int | None) -> UnitTally | None:
        return self._rendered.pop((ds_index, row_index, sample), None)

    def runtime(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ this attempt

    def attempt_entry(self, rows_computed: int, outcome: str = "running", error: str | None = None) -> dict:
        """This attempt's counters, as kept in the checkpoint."""
        phases = self.timer.seconds
        runtime = self.runtime()
        occupancy = self.tracker.summary()
        return {
            "attempt": self.attempt,
            "snakemake_attempt": self.snakemake_attempt,
            "started_at": self.started_at,
            "finished_at": None if outcome == "running" else stats.utc_now(),
            "outcome": outcome,
            "error": redact_text(error),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "runtime_seconds": runtime,
            "model_load_seconds": phases.get("load", 0.0),
            "warmup_seconds": phases.get("warmup", 0.0),
            "generation_seconds": phases.get("generate", 0.0),
            "inference_runtime_seconds": self.tracker.window_seconds,
            "write_seconds": phases.get("write", 0.0),
            "engine_busy_seconds": occupancy["engine_busy_seconds"],
            "engine_idle_seconds": occupancy["engine_idle_seconds"],
            "engine_idle_gaps": occupancy["engine_idle_gaps"],
            "peak_inflight": occupancy["peak_inflight"],
            "rows_computed": rows_computed,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_tokens_each_choice": self.input_tokens_each_choice,
            "images": self.images,
            "image_tokens": self.image_tokens,
            "requests_cached": self.requests_cached,
            "answers": self.answers,
            "answers_length_cut": self.answers_length_cut,
            "json_answers": self.json_answers,
            "num_gpus": self.num_gpus,
            "gpu_seconds_allocated": self.num_gpus * runtime,
            "engine_restarts": sum(e.restarts() for e in list(self.engines.values())),
            "cost_usd": self.cost_usd(runtime),
            "unpriced_tokens": self.unpriced_tokens,
            "engine_deaths": [{"processor": name, **d} for name, e in list(self.engines.items()) for d in e.deaths()],
        }

    def begin_attempt(self, checkpoint) -> None:
        """Add this attempt to the checkpoint's list, numbered after the earlier ones; one left
        "running" there was killed."""
        for earlier in checkpoint.attempts:
            if earlier.get("outcome") == "running":
                earlier["outcome"] = "killed"
        self.attempt = len(checkpoint.attempts) + 1
        self.checkpoint = checkpoint
        self.index = checkpoint.begin_attempt(self.attempt_entry(0))

    def save_attempt(self, rows_computed: int, outcome: str = "running", error: str | None = None) -> None:
        """This attempt's counters into the checkpoint (written with its next save)."""
        self.checkpoint.update_attempt(self.index, self.attempt_entry(rows_computed, outcome, error))

    # ------------------------------------------------------------------ all attempts

    def stats(self, budget, resumed: int, attempts: list[dict] | None = None, request_cache: dict | None = None) -> dict:
        """status.json's ``stats``: sums over the attempts (this one last), rates from the sums,
        and the record figures of the committed parts (``record_*``, the tokens histogram).
        Its keys are ``state.records.STATS_FIELDS``' (a test pins them); the summed ones come
        from there. ``request_cache``: what the request cache holds now (when it is on).

        GPU utilisation and energy are sampled by this attempt only.
        """
        if attempts is None:
            attempts = self.checkpoint.attempts if self.checkpoint is not None else [self.attempt_entry(budget.computed, "failed")]
        total = {k: sum(a.get(k) or 0 for a in attempts) for k in STATS_SUMMED}
        done, failed = budget.totals()
        runtime, window = total["runtime_seconds"], total["inference_runtime_seconds"]
        out_tokens, num_gpus = total["output_tokens"], self.num_gpus
        gpus = self.sampler.summary()
        return {
            **total,
            "n_samples": self.cfg.n_samples,  # records per source row: the rows_* counts below count records
            "runtime_human": stats.human_duration(runtime),
            "peak_inflight": max((a.get("peak_inflight") or 0 for a in attempts), default=0),
            "rows_processed": done,
            "rows_failed": failed,
            "rows_filtered": budget.filtered,  # dropped by a filter step: neither ok nor failed
            "rows_failed_by_class": dict(budget.failed_classes()),
            "rows_resumed": resumed,
            "throughput_rows_per_sec": total["rows_computed"] / runtime if runtime > 0 else None,
            "num_gpus": num_gpus,
            **stats.rate_figures(out_tokens, window, num_gpus),
            **stats.wall_rate_figures(out_tokens, runtime, num_gpus),
            **gpus,
            "joules_per_1k_output_tokens": stats.joules_per_1k_tokens(gpus["gpu_energy_joules"], self.output_tokens),
            **self._roofline(stats.tokens_per_sec_per_gpu(self.output_tokens, self.tracker.window_seconds, num_gpus)),
            # what the committed records hold, counted once per record whatever the attempts did
            **(self.checkpoint.records_tally() if self.checkpoint is not None else RecordTally.merge([])),
            # each death of a launched server, every attempt's (engines/server_restarts.py), oldest first
            "engine_deaths": [{"attempt": a.get("attempt"), **d} for a in attempts for d in a.get("engine_deaths") or ()],
            # (attempts of earlier versions kept a work histogram each: not shown)
            "attempts": [{k: v for k, v in a.items() if k not in ("output_tokens_per_row_hist", "engine_deaths")} for a in attempts],
            **({} if request_cache is None else {"request_cache": request_cache}),
        }

    def _roofline(self, tokens_per_sec_per_gpu: float | None) -> dict:
        """Decode roofline of this attempt's model on its GPUs (one processor, one GPU model), else nulls."""
        names = {g["name"] for g in self.sampler.hardware()["gpus"]}
        procs = list(self.cfg.processors.values())
        model = stats.model_memory_facts(procs[0].server_args.model_path) if len(procs) == 1 else None
        batch = None
        if procs and self.tracker.peak:
            args = procs[0].server_args
            batch = self.tracker.peak / (args.dp_size or 1)  # sequences per replica
            cap = args.extra_engine_args.get("max_running_requests")
            batch = min(batch, cap) if cap else batch
        return stats.roofline_figures(
            model, names.pop() if len(names) == 1 else None, self.tracker.peak, self.input_tokens, self.output_tokens,
            self.requests, tokens_per_sec_per_gpu, sequences_per_gpu=batch,
        )  # fmt: skip

    def server_figures(self, engines: dict) -> dict | None:
        """Per processor whose engine read its server's /metrics (vllm_server, sglang_server
        with enable_metrics): the server's own figures over this attempt, and our token
        totals of this attempt beside its counters (engines/server_metrics.py); None when none did."""
        from mirageflow.engines.server_metrics import reconcile

        out = {}
        for name, engine in engines.items():
            server = (engine.info.details or {}).get("server_metrics")
            if not server:
                continue
            mine = self.by_processor.get(name) or {"input_tokens": 0, "output_tokens": 0, "input_tokens_each_choice": 0}
            tokens = reconcile(mine["input_tokens"], mine["output_tokens"], mine["input_tokens_each_choice"], server)
            out[name] = {"backend": engine.info.backend, "attempt": self.attempt, **server, "tokens": tokens}
        return out or None

    def hardware(self) -> dict:
        return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), **self.sampler.hardware()}

    def model_facts(self) -> dict:
        """Weight and KV-cache bytes of each processor's local model dir (for the roofline); null when unknown."""
        return {name: stats.model_memory_facts(p.server_args.model_path) for name, p in self.cfg.processors.items()}

    def write_gpu_samples(self, shard_dir: Path, shard_id: int) -> None:
        timeline = self.sampler.timeline_json()
        if timeline is not None:
            try:
                atomic_write_json(shard_dir / "gpu_samples.json", {"shard_id": shard_id, **timeline})
            except OSError as e:  # the samples are for plots; the shard's records matter more
                log.warning("cannot write gpu_samples.json: %s", e)
