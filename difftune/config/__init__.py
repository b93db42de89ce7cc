"""The run configuration: pydantic models for every section, and `load_config`.

A run is one TOML file with the sections `model`, `precision`, `adapter`, `[[datasets]]`,
`cache`, `train`, `sample` and `save`. Everything is validated when it loads, before anything
heavy runs: unknown keys are rejected, every problem is reported at once with its dotted field
and a fix, and cross-field conflicts (family-dependent ones included) are resolved or refused
now rather than discovered mid-run. Relative paths are taken relative to the config file.

The package's modules, each with one job (imports only run downwards in this list):
`base` (shared field types and tables), `errors` (pydantic errors as user messages, `--set`),
`data` (datasets, subsets, cache), `adapter` (what trains), `sections` (model, precision,
train, sample, save),
`checks` (cross-field and family checks), `run` (`RunConfig`), `load` (`load_config`).
"""

from __future__ import annotations

from difftune.config.base import QUANT_BACKENDS
from difftune.config.checks import model_file_problems, warn_ignored
from difftune.config.data import CacheConfig, DatasetConfig, SubsetConfig
from difftune.config.load import load_config, parse_config
from difftune.config.run import RunConfig
from difftune.config.adapter import TEXT_ENCODER_TARGETS, AdapterConfig, EmbeddingConfig
from difftune.config.sections import (ModelConfig, PrecisionConfig, QuantizeConfig, SampleConfig,
                                      SaveConfig, TrainConfig)

__all__ = ["QUANT_BACKENDS", "TEXT_ENCODER_TARGETS", "AdapterConfig", "CacheConfig",
           "DatasetConfig", "EmbeddingConfig", "ModelConfig", "PrecisionConfig", "QuantizeConfig",
           "RunConfig", "SampleConfig", "SaveConfig", "SubsetConfig", "TrainConfig",
           "load_config", "model_file_problems", "parse_config", "warn_ignored"]
