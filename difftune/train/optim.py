"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch

from difftune.config import TrainConfig


def make_optimizer(params: list[torch.nn.Parameter] | list[dict[str, Any]],
                   cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (or parameter groups, each may set its own lr):
    torch's, bitsandbytes' 8-bit one (train.optimizer = "adamw8bit", checked to run on CUDA
    before the model loaded), or the fused-backward one that steps inside backward."""
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    if cfg.fused_backward:
        from difftune.memory.fused import FusedAdamW

        opt = FusedAdamW(params, **kwargs)
        opt.clip = cfg.max_grad_norm
        opt.attach()
        return opt
    return torch.optim.AdamW(params, **kwargs)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.scheduler == "linear":
        return 1.0 - progress
    if cfg.scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
