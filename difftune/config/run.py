"""The whole run: `RunConfig` joins the sections and refuses cross-field conflicts at once."""

from __future__ import annotations

from pydantic import Field, model_validator

from difftune.config import checks, objectives
from difftune.config.base import Section as _Section
from difftune.config.experts import expert_problems
from difftune.config.full import full_problems
from difftune.config.sharding import sharding_problems
from difftune.config.preservation import PreservationConfig, preservation_problems
from difftune.config.data import CacheConfig, DatasetConfig
from difftune.config.adapter import AdapterConfig
from difftune.config.sections import (ModelConfig, PrecisionConfig, SampleConfig, SaveConfig,
                                      TrainConfig)
from difftune.config.validation import ValidationConfig, validation_problems
from difftune.config.keep_best import keep_best_problems
from difftune.config.metrics import MetricsConfig


class RunConfig(_Section):
    """The whole run."""

    model: ModelConfig  # required: the default (no source) is never valid
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    datasets: list[DatasetConfig] = Field(..., min_length=1)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    save: SaveConfig
    preservation: PreservationConfig = Field(default_factory=PreservationConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        problems = []
        p = self.precision
        low = [f"precision.{k} = \"{v}\"" for k, v in p.dtype_names().items() if v != "fp32"]
        if p.mixed == "no" and low:
            problems.append(
                f"{', '.join(low)} needs precision.mixed = \"bf16\" or \"fp16\" (fp32 compute "
                "on low-precision weights fails); set precision.mixed or keep those at fp32"
            )
        problems += checks.quantize_problems(p, self.train.device)
        problems += objectives.objective_problems(self.model.family, self.train)
        problems += checks.text_encoder_problems(self.model, self.adapter, self.save.format, p)
        problems += checks.unload_problems(self)
        problems += checks.embedding_problems(self)
        problems += checks.adapter_kind_problems(self)
        problems += checks.control_problems(self)
        problems += checks.warmup_problems(self)
        problems += checks.memory_problems(self)
        problems += full_problems(self)
        problems += expert_problems(self)
        problems += checks.optimizer_problems(self)
        problems += sharding_problems(self)
        problems += preservation_problems(self)
        problems += validation_problems(self.validation, self.train.steps)
        problems += keep_best_problems(self)
        every = self.save.every_n_steps
        if every is not None and every > self.train.steps:
            problems.append(
                f"save.every_n_steps ({every}) is larger than train.steps ({self.train.steps}); "
                "lower it or leave it unset (the end of the run is always saved)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self
