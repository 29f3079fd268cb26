"""The shard job: one shard of every dataset through the pipeline (``runner.run_shard``).

The package imports only how a shard ends (failures.py): ``import mirageflow.shard.checkpoint``
or ``mirageflow.shard.progress`` (the Snakefile's parse, the report) loads neither the runner
nor, with it, the engines, the prompts, jinja2 and tqdm. Its names are imported from their
modules (``from mirageflow.shard.runner import run_shard``): no module of the package is
imported by the package back."""

from mirageflow.shard.failures import ShardFailed, ShardInterrupted

__all__ = ["ShardFailed", "ShardInterrupted"]
