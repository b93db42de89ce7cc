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


def per_sample(err: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One loss per sample: the mean of its elements' errors or, with `mask` ((B, h, w) weights
    over the last two axes of `err`, the latent grid), their weighted mean
    sum(mask * err) / sum(mask) over each sample's elements (normalized by the masked area)."""
    if mask is None:
        return err.flatten(1).mean(dim=1) if err.dim() > 1 else err
    w = _on_grid(mask, err)
    total = w.expand_as(err).flatten(1).sum(dim=1)
    return (err * w).flatten(1).sum(dim=1) / total.clamp_min(torch.finfo(torch.float32).tiny)


def _on_grid(mask: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """(B, h, w) weights shaped to broadcast over `err`'s (B, ..., h, w) axes, in fp32."""
    b, h, w = mask.shape
    if tuple(err.shape[-2:]) != (h, w):  # a family's prediction must come back on the grid
        raise ValueError(f"loss mask {tuple(mask.shape)} does not match the prediction's "
                         f"latent grid {tuple(err.shape)}")
    return mask.to(err.device, torch.float32).view(b, *[1] * (err.dim() - 3), h, w)


def batch_mean(per: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's loss: per-sample losses times their weights (if any), averaged."""
    if weights is not None:
        per = per * weights.to(per.device, torch.float32)
    return per.mean()
