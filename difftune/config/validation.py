"""The `[validation]` section: a held-out set whose loss is measured every N steps.

The loss is taken at fixed timesteps with fixed noise, so one evaluation compares with the
next and one run with another; the training RNG streams are never touched, so a run with
validation trains bit for bit like one without (when nothing is held out of its data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from difftune.config.base import Section

# `enabled = "auto"` turns validation on when the training datasets hold at least this many
# images (before the split): below that, holding any out costs the run too much of its data.
AUTO_MIN_IMAGES = 20


class ValidationConfig(Section):
    """Validation loss: which images, how often, at which timesteps, and what it decides."""

    enabled: Literal["auto"] | bool = Field(
        "auto", description=f"auto: on when `path` is set or the training datasets hold at "
        f"least {AUTO_MIN_IMAGES} images; true; false.")
    fraction: float = Field(
        0.1, gt=0, lt=1, description="Share of each dataset's ordinary images held out of "
        "training (chosen by a stable hash of the image's path and `seed`; at least 1).")
    path: Path | None = Field(
        None, description="A folder of images with captions used as the validation set "
        "instead (nothing is then held out of training).")
    every_n_steps: int = Field(50, ge=1, description="Evaluate after every N steps (and at "
                               "the last step).")
    timesteps: int = Field(4, ge=1, le=64, description="Fixed timesteps, spread evenly over "
                           "the objective's range.")
    seed: int = Field(0, description="Seed of the fixed noise (and of the held-out choice).")
    early_stop_patience: int | None = Field(
        None, ge=0, description="Stop after this many evaluations without improvement "
        "(0 or unset: never).")
    min_delta: float = Field(0.0, ge=0, description="An evaluation improves when it is lower "
                             "than the best by more than this.")
    keep_best: bool = Field(False, description="Write <name>-best.safetensors whenever the "
                            "validation loss improves.")

    @model_validator(mode="after")
    def _patience(self) -> "ValidationConfig":
        if self.early_stop_patience == 0:
            object.__setattr__(self, "early_stop_patience", None)
        return self

    def decides(self) -> bool:
        """Whether the validation loss decides something (early stop, keep the best)."""
        return self.early_stop_patience is not None or self.keep_best


def validation_problems(v: ValidationConfig, steps: int, images: int | None = None) -> list[str]:
    """Cross-field conflicts of `[validation]` with the run (`steps` = train.steps)."""
    problems = []
    if v.enabled is False and v.decides():
        what = "validation.early_stop_patience" if v.early_stop_patience else "validation.keep_best"
        problems.append(f"{what} needs validation: set validation.enabled = true (or \"auto\") "
                        "or remove it")
    if v.enabled is True and v.every_n_steps > steps:
        problems.append(f"validation.every_n_steps ({v.every_n_steps}) is larger than "
                        f"train.steps ({steps}); lower it (the last step is always evaluated) "
                        "or set validation.enabled = false")
    return problems
