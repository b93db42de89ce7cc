"""A batch's training loss in the pieces every loss option composes with.

`elementwise` is the error of each latent element (squared error; the loss options add
theirs), `per_sample` reduces it to one number per sample (weighted by a mask where the batch
has one), `batch_mean` applies per-sample weights (the objective's, a subset's) and averages.
All in fp32 whatever the autocast dtype, so the loss is the same number under every precision.
"""

from __future__ import annotations

from typing import Any

import torch


def elementwise(pred: torch.Tensor, target: torch.Tensor, loss: str = "l2",
                delta: torch.Tensor | float | None = None) -> torch.Tensor:
    """The error of each element, in fp32, by `train.loss` (`delta`: a number, or one per
    sample from `huber_deltas`):

    - l2: x² (x = pred - target);
    - huber: x² where |x| <= delta, 2 delta |x| - delta² beyond: twice torch's huber_loss,
      so it equals l2 for small errors and grows like sd-scripts' (pseudo-)Huber 2 delta |x|;
    - smooth_l1: huber / delta (twice torch's smooth_l1_loss with beta = delta): x² / delta,
      then 2 |x| - delta.
    """
    x = pred.float() - target.float()
    if loss == "l2":
        return x.pow(2)
    d = torch.as_tensor(0.1 if delta is None else delta, dtype=torch.float32, device=x.device)
    d = d.view(-1, *([1] * (x.dim() - 1))) if d.dim() == 1 else d
    ax = x.abs()
    err = torch.where(ax <= d, x.pow(2), 2 * d * ax - d.pow(2))
    if loss == "smooth_l1":
        return err / d
    if loss != "huber":
        raise ValueError(f"train.loss must be l2, huber or smooth_l1, got {loss!r}")
    return err


def options(train: Any, objective: Any, t: torch.Tensor) -> tuple[str, torch.Tensor | None]:
    """(`train.loss`, its per-sample delta at timesteps `t`), `elementwise`'s last arguments;
    `objective` tells where t lies (`noise_level`)."""
    if train.loss == "l2":
        return "l2", None
    position, ratio = objective.noise_level(t)
    return train.loss, huber_deltas(train.huber_delta, train.huber_schedule, position, ratio)


def huber_deltas(delta: float, schedule: str, position: torch.Tensor,
                 ratio: torch.Tensor) -> torch.Tensor:
    """Per-sample delta for `train.huber_schedule` (sd-scripts' schedules): `position` is the
    timestep from clean 0 to pure noise 1, `ratio` the noise-to-signal ratio sigma.

    constant: delta; exponential: delta ** position (1 at the clean end, delta at pure noise);
    snr: (1 - delta) / (1 + sigma)² + delta (1 where there is no noise, -> delta as noise grows).
    """
    position = position.float()
    if schedule == "constant":
        return torch.full_like(position, delta)
    if schedule == "exponential":
        return torch.exp(position * torch.log(torch.tensor(delta)))
    if schedule == "snr":
        return (1 - delta) / (1 + ratio.float()).pow(2) + delta
    raise ValueError(f"train.huber_schedule must be constant, exponential or snr, got {schedule!r}")


def per_sample(err: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One loss per sample: the mean of its elements' errors or, with `mask` ((B, h, w) weights
    over the last two axes of `err`, the latent grid; (B, f, h, w) over the last three for
    clips), their weighted mean
    sum(mask * err) / sum(mask) over each sample's elements (normalized by the masked area)."""
    if mask is None:
        return err.flatten(1).mean(dim=1) if err.dim() > 1 else err
    w = _on_grid(mask, err)
    total = w.expand_as(err).flatten(1).sum(dim=1)
    return (err * w).flatten(1).sum(dim=1) / total.clamp_min(torch.finfo(torch.float32).tiny)


def _on_grid(mask: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """(B, h, w) weights ((B, f, h, w) for clips) shaped to broadcast over `err`'s
    (B, ..., h, w) ((B, ..., f, h, w)) axes, in fp32."""
    b, *grid = mask.shape
    if list(err.shape[len(err.shape) - len(grid):]) != grid:  # the prediction's grid
        raise ValueError(f"loss mask {tuple(mask.shape)} does not match the prediction's "
                         f"latent grid {tuple(err.shape)}")
    return mask.to(err.device, torch.float32).view(b, *[1] * (err.dim() - 1 - len(grid)), *grid)


def batch_mean(per: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's loss: per-sample losses times their weights (if any), averaged."""
    if weights is not None:
        per = per * weights.to(per.device, torch.float32)
    return per.mean()
