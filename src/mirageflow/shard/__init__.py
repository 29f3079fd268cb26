"""The shard job (see runner.py): one shard of every dataset through the pipeline.

The runner (and with it the engines, the prompts, jinja2 and tqdm) is imported when one of
its names is first used, not with the package: ``import mirageflow.shard.checkpoint`` or
``mirageflow.shard.progress`` (the Snakefile's parse, the report) needs none of it."""

from mirageflow.shard.failures import ShardFailed, ShardInterrupted

__all__ = ["ShardFailed", "ShardInterrupted", "ShardRunner", "index_datasets", "index_path", "run_shard"]
_RUNNER_NAMES = {"ShardRunner", "index_datasets", "index_path", "run_shard"}


def __getattr__(name: str):
    if name in _RUNNER_NAMES:
        from mirageflow.shard import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
