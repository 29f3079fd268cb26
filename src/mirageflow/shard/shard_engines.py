"""What a shard computes its outputs with (a part of shard/runner.py): the LLM engines (one per
processor an ``llm`` output names), the image generators (``image_gen`` outputs) and the
custom steps' worker pools. Loaded only once there is work the request cache cannot answer,
warmed up, stopped at once on SIGTERM/SIGINT, closed at the shard's end.
"""

from __future__ import annotations

import gc
import logging
from collections import ChainMap
from typing import Callable

from mirageflow.config import PipelineConfig, processor_identity
from mirageflow.engines.base import Engine
from mirageflow.engines.registry import capabilities
from mirageflow.imagegen import ImageGenerator, make_generator
from mirageflow.shard import request_cache
from mirageflow.shard.steps import python as python_steps
from mirageflow.state.layout import StateLayout
from mirageflow.stats import pricing
from mirageflow.transport.spend import SpendLedger

log = logging.getLogger(__name__)


class ShardEngines:
    """The engines, image generators and worker pools of one shard; ``metrics`` (ShardMetrics)
    counts their restarts and deaths and the GPUs they hold."""

    def __init__(self, cfg: PipelineConfig, shard_id: int, engine_factory: Callable, log_dir, metrics, samples: int):
        self.cfg, self.shard_id, self.params, self.samples = cfg, shard_id, cfg.shard, samples
        self.engine_factory, self.log_dir, self.metrics = engine_factory, log_dir, metrics
        self.engines: dict[str, Engine] = {}
        self.pools: dict[str, python_steps.FunctionPool] = {}  # custom processors' worker processes
        self.image_gens: dict[str, ImageGenerator] = {}  # image_gen processors' generators (mirageflow.imagegen)
        # their launched servers' restarts and deaths (LLM engines' and image generators'), in each attempt's counters
        metrics.engines = ChainMap(self.engines, self.image_gens)

    def load(self, checkpoint, live, stopping: Callable[[], bool]) -> None:
        """Start the pools, load every engine and generator (a batch API's bound to the shard's
        ``checkpoint``), then warm up those that do; ``live`` shows the phase, ``stopping``
        says whether the shard got SIGTERM/SIGINT."""
        live.set_phase("loading")
        with self.metrics.timer.phase("load"):
            # a custom step's worker dying of SIGTERM is the job's cancellation only when the shard got one too
            self.pools = python_steps.start_pools(self.cfg.custom_processors, self.cfg.outputs, stopping=stopping)
            for name in {o.processor for o in self.cfg.outputs if o.kind == "llm"}:
                engine = self.engine_factory(self.cfg.processors[name], self.cfg.batch_size, log_dir=self.log_dir)
                if self.params.max_inflight:  # engines size their pools at load
                    engine.max_inflight = self.params.max_inflight
                engine.commit_seconds = self.params.checkpoint_seconds
                # one pace for the run's shards under the processor's rate limits
                engine.rate_limit_file = StateLayout(self.cfg.shared_state_dir).rate_limits(name)
                engine.spend_ledger = self._spend_ledger(name)
                if engine.keeps_state:  # a provider's batches, across attempts (engines/batch_api.py)
                    engine.bind_state(checkpoint, self.shard_id, self.samples)
                self.engines[name] = engine
                engine.load()
            for name in {o.processor for o in self.cfg.outputs if o.kind == "image_gen"}:
                self.image_gens[name] = generator = make_generator(self.cfg.image_processors[name], self.log_dir)
                generator.load()
            gc.collect()  # what loading left behind, once (counted as load: ~0.3 s with transformers)
        shares = {
            e.info.details["shared_engine"]["group"]: e.gpu_share for e in self.engines.values() if e.gpu_share is not None
        }  # fmt: skip
        if shares:  # served by an engine service: the GPUs are its, this shard counts its share
            self.metrics.num_gpus = sum(shares.values())
        warming = [e for e in self.engines.values() if e.warms_up]
        if warming:  # engines that warm up (compile, capture graphs) before serving
            live.set_phase("warmup")
            with self.metrics.timer.phase("warmup"):
                for engine in warming:
                    engine.warmup()

    def cache_identities(self, engines: dict[str, Engine]) -> dict[str, str]:
        """Per processor, the engine identity of its requests' cache keys (shard/request_cache.py);
        ``engines``: these, or the request cache's stand-ins."""
        out = {}
        for name, engine in engines.items():
            proc = self.cfg.processors[name]
            # a model this node loads (or its engine service does) has a revision to read; a remote server's is its name
            revision = request_cache.model_revision(proc.server_args.model_path) if capabilities(proc.backend).loads_model else None
            out[name] = request_cache.engine_identity(processor_identity(self.cfg, name), engine.info.backend, revision)
        return out

    def _spend_ledger(self, processor: str):
        """The run's spend ledger for a processor's requests under execution_params.max_cost_usd
        (transport/spend.py); None without a budget, or for a processor that costs nothing."""
        cap = self.cfg.execution.max_cost_usd
        price = self.metrics.prices.get(processor)
        if cap is None or price is None or price == pricing.FREE:
            return None
        p = self.cfg.processors[processor]
        stale = (p.max_retries + 1) * float(p.request_timeout) + p.max_retries * 60.0  # longer than one request can take
        return SpendLedger(StateLayout(self.cfg.shared_state_dir).spend, cap, price, stale)

    def stop(self, signum: int) -> None:
        """SIGTERM/SIGINT: every engine and generator fails its outstanding requests at once."""
        for engine in [*self.engines.values(), *self.image_gens.values()]:
            engine.stop()

    def close(self) -> None:
        python_steps.close_pools(self.pools)
        for engine in [*self.engines.values(), *self.image_gens.values()]:
            try:
                engine.close()
            except Exception:  # closing must not hide the shard's own error
                log.exception("closing engine failed")
