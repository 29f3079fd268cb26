"""The shard job (see runner.py): one shard of every dataset through the pipeline."""

from mirageflow.shard.failures import ShardFailed, ShardInterrupted
from mirageflow.shard.runner import ShardRunner, index_datasets, index_path, run_shard

__all__ = ["ShardFailed", "ShardInterrupted", "ShardRunner", "index_datasets", "index_path", "run_shard"]
