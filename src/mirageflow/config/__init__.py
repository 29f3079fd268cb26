"""The pipeline config: schema, loading and validation, and the driver's preflight checks.

``loading`` turns a YAML file into a validated, typed ``PipelineConfig`` (every problem at
once, with key paths); ``preflight`` looks at the data and model files (driver only).
"""

from mirageflow.config.loading import (
    ConfigError,
    DatasetConfig,
    InputVar,
    OutputVar,
    PipelineConfig,
    ProcessorConfig,
    load_config,
    records_identity,
)

__all__ = [
    "ConfigError",
    "DatasetConfig",
    "InputVar",
    "OutputVar",
    "PipelineConfig",
    "ProcessorConfig",
    "load_config",
    "records_identity",
]
