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
from typing import Any, Iterator

import torch

from difftune.adapters.lora import lora_parameters
from difftune.data.sampler import Batch, BucketBatchSampler
from difftune.train.guard import NonFiniteGuard, TrainingDiverged
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
    groups = param_groups(run)
    params = [p for g in groups for p in g["params"]]
    opt = make_optimizer(groups, cfg.train)
    sched = make_scheduler(opt, cfg.train)
    scaler = torch.amp.GradScaler(run.policy.device.type, enabled=cfg.precision.mixed == "fp16")
    batches = BucketBatchSampler(run.data, cfg.train.batch_size, cfg.train.seed).batches()
    generator = torch.Generator("cpu").manual_seed(cfg.train.seed)
    result = Result()
    if cfg.sample.at_start and hooks.sampler:
        hooks.sampler.run(0)
    set_training(run, True)
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps, cfg.precision.mixed, cfg.train.lr)
    for step in range(1, cfg.train.steps + 1):
        loss, epoch = _accumulate(run, batches, generator, scaler, step - 1)
        if guard.skip(step, loss):
            # Nothing is applied: gradients dropped, schedule advanced to stay on the step count.
            opt.zero_grad(set_to_none=True)
            lr = sched.get_last_lr()[0]
            sched.step()
            if guard.exhausted:
                set_training(run, False)
                path = hooks.checkpoints.save_lora(model, step)
                raise TrainingDiverged(guard.message(step, path))
        else:
            lr = _optimizer_step(opt, sched, scaler, params, cfg.train.max_grad_norm)
            guard.scaler_skipped(scaler)
        result.losses.append(loss)
        hooks.reporter.step(step, loss, lr, {"epoch": epoch, **guard.counts()})
        _between_steps(run, hooks, step)
    set_training(run, False)
    result.lora = hooks.checkpoints.save_lora(model, cfg.train.steps, final=True)
    if cfg.sample.at_end and hooks.sampler:
        hooks.sampler.run(cfg.train.steps)
    return result


def param_groups(run: Run) -> list[dict[str, Any]]:
    """Optimizer groups: the denoiser LoRA at train.lr, the text-encoder LoRAs at their own lr."""
    groups: list[dict[str, Any]] = [{"params": lora_parameters(run.comps.denoiser)}]
    encoders = run.trained_encoders
    if encoders:
        lr = run.cfg.adapter.text_encoder_lr or run.cfg.train.lr
        params = [p for e in encoders.values() for p in lora_parameters(e)]
        groups.append({"params": params, "lr": lr})
    return groups


def set_training(run: Run, on: bool) -> None:
    """Train (dropout on) or eval mode for every module with a LoRA: denoiser and encoders."""
    for module in (run.comps.denoiser, *run.trained_encoders.values()):
        module.train(on)


def _accumulate(run: Run, batches: Iterator[Batch], generator: torch.Generator,
                scaler: torch.amp.GradScaler, done: int) -> tuple[float, int]:
    """Forward and backward over `grad_accum` micro-batches; returns (mean loss, epoch).

    `done` is the number of optimizer steps already taken (what token warm-up counts).
    """
    accum = run.cfg.train.grad_accum
    total: torch.Tensor | float = 0.0
    for _ in range(accum):
        batch = next(batches)
        loss = batch_loss(run, list(batch.indices), list(batch.flips), generator,
                          list(batch.seeds), done)
        # Skipping the no-op division and scaling keeps the common case free of extra kernels.
        scaled = loss / accum if accum > 1 else loss
        if bool(torch.isfinite(scaled)):  # a non-finite loss is never backpropagated
            (scaler.scale(scaled) if scaler.is_enabled() else scaled).backward()
        total = total + scaled.detach()
    return float(total), batch.epoch


def _optimizer_step(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                    scaler: torch.amp.GradScaler, params: list[torch.nn.Parameter],
                    max_norm: float | None) -> float:
    """Clip, step, advance the schedule and clear gradients; returns the lr that was used."""
    if max_norm is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(opt)
    scaler.update()
    lr = sched.get_last_lr()[0]
    sched.step()
    opt.zero_grad(set_to_none=True)
    return lr


def _between_steps(run: Run, hooks: Hooks, step: int) -> None:
    """Save and sample when due (the end of the run is handled by `train`)."""
    cfg = run.cfg
    if step == cfg.train.steps:
        return
    if _due(step, cfg.save.every_n_steps):
        hooks.checkpoints.save_lora(run.comps.denoiser, step)
    if hooks.sampler and _due(step, cfg.sample.every_n_steps):
        hooks.sampler.run(step)
