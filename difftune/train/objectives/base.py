"""What every training objective shares: the `Draw` of one batch, the `Objective` protocol, and
the loss (mean squared error in fp32, optionally weighted per sample)."""

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


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error in fp32, times per-sample weights, averaged over the batch."""
    err = (pred.float() - target.float()).pow(2)
    per_sample = err.flatten(1).mean(dim=1) if err.dim() > 1 else err
    return (per_sample * weights.to(per_sample.device, torch.float32)).mean()


def loss(pred: torch.Tensor, target: torch.Tensor,
         weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in fp32 whatever the autocast dtype; per-sample weighted if given."""
    if weights is None:
        return torch.nn.functional.mse_loss(pred.float(), target.float())
    return weighted_mse(pred, target, weights)
