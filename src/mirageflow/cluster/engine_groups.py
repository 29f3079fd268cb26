"""Which shards an engine service serves (``execution_params.shards_per_engine`` > 1).

Apart from the service itself (cluster/engine_service.py, which imports the engines and the
HTTP layer) because the Snakefile asks this of every shard while it is parsed
(workflow/rules/common.smk: engine_endpoint), in the driver and in every cluster job.
"""

from __future__ import annotations

from mirageflow.config.types import PipelineConfig
from mirageflow.engines import registry


def served_processors(cfg: PipelineConfig) -> list[str]:
    """Processors an engine service loads: those the outputs use whose backend loads a model
    (not a remote server's API, as openai: the shard calls it itself, nothing to load)."""
    used = sorted({o.processor for o in cfg.outputs if o.processor in cfg.processors})
    return [name for name in used if registry.capabilities(cfg.processors[name].backend).loads_model]


def group_of(cfg: PipelineConfig, shard_id: int) -> int | None:
    """The engine group of ``shard_id``, or None when its shards load their own engines."""
    k = cfg.execution.shards_per_engine
    if k <= 1 or not served_processors(cfg):
        return None
    return shard_id // k
