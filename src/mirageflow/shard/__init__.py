"""The shard job (see runner.py): one shard of every dataset through the pipeline.

The runner (and with it the engines, the prompts, jinja2 and tqdm) is imported from
``mirageflow.shard.runner`` by whoever runs a shard, never by this package: ``import
mirageflow.shard.checkpoint`` or ``mirageflow.shard.progress`` (the report, the CLI) needs
none of it, and the runner's modules import this package without a circle."""

from mirageflow.shard.failures import ShardFailed, ShardInterrupted

__all__ = ["ShardFailed", "ShardInterrupted"]
