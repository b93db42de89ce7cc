"""The training loop: batches -> loss -> backward -> optimizer -> hooks.

Randomness (noise, timesteps) comes from one CPU generator seeded from `train.seed`, the data
order from the seeded bucket sampler and the LoRA init from the same seed, so the same config
gives the same LoRA on the CPU. Hooks (reporting, saving, sampling) run between steps and never
touch that generator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftune.adapters.lora import lora_parameters
from difftune.data.sampler import BucketBatchSampler
from difftune.report import Reporter
from difftune.sample import SampleRunner
from difftune.train.checkpoint import CheckpointManager
from difftune.train.optim import make_optimizer, make_scheduler
from difftune.train.setup import Run, batch_loss

log = logging.getLogger("difftune")


@dataclass
class Hooks:
    """What happens between steps."""

    reporter: Reporter
    checkpoints: CheckpointManager
    sampler: SampleRunner | None


@dataclass
class Result:
    """What a finished run produced."""

    losses: list[float] = field(default_factory=list)
    lora: Path | None = None


def _due(step: int, every: int | None) -> bool:
    return every is not None and step % every == 0


def train(run: Run, hooks: Hooks) -> Result:
    """Run `train.steps` optimizer steps; returns per-step losses and the final LoRA path."""
    cfg = run.cfg
    model = run.comps.denoiser
    params = lora_parameters(model)
    opt = make_optimizer(params, cfg.train)
    sched = make_scheduler(opt, cfg.train)
    scaler = torch.amp.GradScaler(run.policy.device.type, enabled=cfg.precision.mixed == "fp16")
    sampler = BucketBatchSampler(run.data, cfg.train.batch_size, cfg.train.seed)
    batches = sampler.batches()
    generator = torch.Generator("cpu").manual_seed(cfg.train.seed)
    result = Result()
    if cfg.sample.at_start and hooks.sampler:
        hooks.sampler.run(0)
    model.train()
    for step in range(1, cfg.train.steps + 1):
        accum = cfg.train.grad_accum
        total = 0.0
        for _ in range(accum):
            batch = next(batches)
            loss = batch_loss(run, list(batch.indices), list(batch.flips), generator,
                              list(batch.seeds))
            scaled = loss / accum if accum > 1 else loss
            (scaler.scale(scaled) if scaler.is_enabled() else scaled).backward()
            total = total + scaled.detach()
        if cfg.train.max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        lr = sched.get_last_lr()[0]
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = float(total)
        result.losses.append(value)
        hooks.reporter.step(step, value, lr, {"epoch": batch.epoch})
        _between_steps(run, hooks, step)
    model.eval()
    result.lora = hooks.checkpoints.save_lora(model, cfg.train.steps, final=True)
    if cfg.sample.at_end and hooks.sampler:
        hooks.sampler.run(cfg.train.steps)
    return result


def _between_steps(run: Run, hooks: Hooks, step: int) -> None:
    """Save and sample when due (the end of the run is handled by `train`)."""
    cfg = run.cfg
    if step == cfg.train.steps:
        return
    if _due(step, cfg.save.every_n_steps):
        hooks.checkpoints.save_lora(run.comps.denoiser, step)
    if hooks.sampler and _due(step, cfg.sample.every_n_steps):
        hooks.sampler.run(step)
