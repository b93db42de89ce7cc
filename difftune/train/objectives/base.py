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
    """How a family is trained: noise, timesteps, target and weighting for clean latents."""

    def draw(self, latents: torch.Tensor, generator: torch.Generator) -> Draw:
        """Noise a batch of clean latents (randomness from `generator` only)."""
        ...
