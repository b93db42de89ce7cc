"""A batch's training loss in the pieces every loss option composes with.

`elementwise` is the error of each latent element (squared error; the loss options add
theirs), `per_sample` reduces it to one number per sample (weighted by a mask where the batch
has one), `batch_mean` applies per-sample weights (the objective's, a subset's) and averages.
All in fp32 whatever the autocast dtype, so the loss is the same number under every precision.
"""

from __future__ import annotations

import torch


def elementwise(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The squared error of each element, in fp32."""
    return (pred.float() - target.float()).pow(2)


def per_sample(err: torch.Tensor) -> torch.Tensor:
    """One loss per sample: the mean of its elements' errors."""
    return err.flatten(1).mean(dim=1) if err.dim() > 1 else err


def batch_mean(per: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's loss: per-sample losses times their weights (if any), averaged."""
    if weights is not None:
        per = per * weights.to(per.device, torch.float32)
    return per.mean()
