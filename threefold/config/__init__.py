"""Typed, nested configuration: dataclasses <- TOML file <- dotted CLI overrides.

Every field carries a one-line doc in its ``metadata["doc"]``. ``load_config`` builds a
``Config`` from an optional TOML file and ``--section.key value`` overrides (overrides win),
then ``validate`` checks it before anything is allocated or any process starts. Errors are
``ConfigError`` with the field, the value and what would be valid; the CLI turns them into a
one-line message and exit code 2.

The package: ``fields`` (``ConfigError``, the documented field), ``model_shape`` (``ModelConfig``), ``schema`` (the other dataclasses, ``describe``), ``presets`` (named
model shapes), ``loading`` (TOML and overrides), ``validation`` (``validate``). Every public
name is imported here, the one path callers use (``threefold.config``).

This package imports nothing of threefold outside itself (it is the bottom layer).
"""

from threefold.config.loading import (
    apply_mapping,
    load_config,
    parse_overrides,
    take_flag,
)
from threefold.config.fields import ConfigError, unknown_value
from threefold.config.model_shape import ModelConfig
from threefold.config.presets import GPT_SHAPES, MODEL_PRESETS
from threefold.config.schema import (
    CP_ALGORITHMS,
    EP_DISPATCHES,
    CP_BALANCES,
    FP8_RECIPES,
    MODEL_FAMILIES,
    PIPELINE_SCHEDULES,
    DEEPSEEK_RECOMPUTE,
    RECOMPUTE_MODES,
    RECOMPUTE_MODULES,
    CheckpointConfig,
    Config,
    DataConfig,
    FaultToleranceConfig,
    LoRAConfig,
    MetricsConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    describe,
    fp8_all_gather,
    module_names,
    param_dtype,
)
from threefold.config.validation import validate

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FaultToleranceConfig",
    "GPT_SHAPES", "MODEL_PRESETS",
    "LoRAConfig", "MetricsConfig", "MODEL_FAMILIES", "ModelConfig", "OptimConfig",
    "CP_ALGORITHMS", "CP_BALANCES", "EP_DISPATCHES", "FP8_RECIPES", "PIPELINE_SCHEDULES",
    "ParallelConfig", "RECOMPUTE_MODES",
    "TrainConfig",
    "apply_mapping", "describe", "fp8_all_gather", "load_config", "param_dtype",
    "CP_ALGORITHMS", "PIPELINE_SCHEDULES", "ParallelConfig", "RECOMPUTE_MODES",
    "DEEPSEEK_RECOMPUTE", "RECOMPUTE_MODULES", "TrainConfig",
    "apply_mapping", "describe", "fp8_all_gather", "load_config", "module_names", "param_dtype",
    "parse_overrides", "take_flag",
    "unknown_value", "validate",
]
