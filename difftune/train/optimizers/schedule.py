"""The learning-rate schedule: warm-up, then constant, linear or cosine decay of the peak lr.

It applies where the optimizer's spec says it does (`OptimizerSpec.schedule`): in full for
most; schedule-free warms up by itself and never decays (the factor stays 1 here); Adafactor's
relative step computes its own step size (the factor stays 1 and the lr is not read).
"""

from __future__ import annotations

import math

import torch

from difftune.config import TrainConfig
from difftune.train.optimizers.specs import OPTIMIZERS, parse_args


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): warm-up, then the schedule
    (1 for optimizers that schedule themselves)."""
    if OPTIMIZERS[cfg.optimizer].schedule(parse_args(cfg.optimizer, cfg.optimizer_args)) != "full":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.scheduler == "linear":
        return 1.0 - progress
    if cfg.scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def make_scheduler(opt: torch.optim.Optimizer,
                   cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
