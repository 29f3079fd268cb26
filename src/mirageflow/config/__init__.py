"""The pipeline config: typed values, schema, loading and validation, and the driver's preflight checks.

``types`` holds the frozen dataclasses every job reads (it imports nothing of the
package); ``loading`` turns a YAML file into a validated ``PipelineConfig`` (every problem
at once, with key paths); ``preflight`` looks at the data and model files (driver only).

``load_config``, ``ConfigError`` and ``records_identity`` are imported from ``loading`` on
first use, so ``from mirageflow.config.types import PipelineConfig`` (an annotation in
any module) does not import the validation's dependencies, nor the modules they import back.
"""

from mirageflow.config.types import (
    ApiOptions,
    CustomProcessor,
    DatasetConfig,
    DedupParams,
    ExecutionParams,
    InputVar,
    LaunchedServer,
    OutputVar,
    PipelineConfig,
    ProcessorConfig,
    ServerArgs,
    ShardParams,
)

_FROM_LOADING = ("ConfigError", "load_config", "processor_identity", "records_identity")

__all__ = [
    "ApiOptions",
    "ConfigError",
    "CustomProcessor",
    "DatasetConfig",
    "DedupParams",
    "ExecutionParams",
    "InputVar",
    "LaunchedServer",
    "OutputVar",
    "PipelineConfig",
    "ProcessorConfig",
    "ServerArgs",
    "ShardParams",
    "load_config",
    "processor_identity",
    "records_identity",
]


def __getattr__(name: str):
    if name in _FROM_LOADING:
        from mirageflow.config import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'mirageflow.config' has no attribute '{name}'")
