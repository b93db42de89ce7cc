"""What every training objective shares: the `Draw` of one batch, the `Objective` protocol, and
what a draw is made of (the loss itself is `train/losses.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Draw:
    """One batch's noising: the denoiser's time input (in the objective's units), its noisy
    input, the regression target and optional per-sample loss weights."""

    t: torch.Tensor
    noisy: torch.Tensor
    target: torch.Tensor
    weights: torch.Tensor | None = None

    def rows(self, where: slice) -> "Draw":
        """The draw of some rows of the batch (one process's share of a global batch)."""
        return Draw(self.t[where], self.noisy[where], self.target[where],
                    None if self.weights is None else self.weights[where])


class Objective(Protocol):
    """How a family is trained: noise, timesteps, target and weighting for clean latents.
    `window` keeps the next draws' times to [low, high) (a two-expert model's active expert's
    side; flow matching, the objective of the only such models), None for all."""

    window: tuple[float, float] | None

    def draw(self, latents: torch.Tensor, generator: torch.Generator) -> Draw:
        """Noise a batch of clean latents (randomness from `generator` only)."""
        ...

    def draw_at(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> Draw:
        """The draw at given times `t` with given `noise` (validation: no randomness)."""
        ...

    def fixed_timesteps(self, n: int) -> torch.Tensor:
        """`n` times spread evenly over the objective's range (validation)."""
        ...

    def noise_level(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: (position from clean 0 to pure noise 1, noise-to-signal ratio), what
        the loss's scheduled Huber delta reads."""
        ...
