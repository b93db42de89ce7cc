"""The state a run continues from: one object the loop hands the checkpoint manager.

`TrainState` holds every part of a run that changes as it trains, besides the weights (which
the checkpoint manager names and saves itself): optimizer, LR schedule, loss scaler, random
generators, data sampler, non-finite guard and the step count. Each part that has state saves
and restores itself (`state_dict` / `load_state_dict`); `TrainState.state_dict` gathers them,
so a new piece of resumable state is one field here and one entry in each of the two methods.

The optimizer is saved by parameter name (`names`: id(param) -> canonical LoRA key), never by
position, so a checkpoint resumes on a base quantized differently, or not at all.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from difftune.config import TrainConfig
from difftune.data.sampler import BucketBatchSampler
from difftune.errors import CheckpointError
from difftune.train.ema import Ema
from difftune.train.guard import NonFiniteGuard
from difftune.train.optimizers.modes import eval_weights
from difftune.train.optimizers.schedule import lr_factor
from difftune.train.rng import GlobalRngs, RunRngs

SEP = "::"
STATE = "state"  # a group's entry holding its parameters' plain state values


@dataclass
class Snapshot:
    """The run's position and random states between two steps (cheap: no weights, no
    dataset fingerprint), what a rescue checkpoint of that step needs."""

    step: int
    epoch: int
    position: int
    guard: dict[str, float]
    generator: torch.Tensor
    rngs: GlobalRngs


@dataclass
class TrainState:
    """Where a run stands after `step` optimizer steps; what a checkpoint saves besides the
    weights, and what a resumed run continues from.

    `params` are the trained parameters in optimizer order and `updating` says the optimizer
    is inside its update (weights may be half-changed); neither is saved.
    """

    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    rngs: RunRngs
    sampler: BucketBatchSampler
    guard: NonFiniteGuard
    names: dict[int, str]
    train: TrainConfig
    params: list[torch.nn.Parameter]
    step: int = 0
    updating: bool = False
    ema: Ema | None = None
    # The validation loss's record (train/validation.py): best, best_step, bad evaluations.
    validation: dict[str, Any] = field(default_factory=dict)

    def eval_weights(self) -> AbstractContextManager[None]:
        """Inside: the trained parameters hold the optimizer's evaluation weights (schedule-
        free's average; the same weights for other optimizers), for sampling and LoRA files."""
        return eval_weights(self.opt, self.params)

    @property
    def generator(self) -> torch.Generator:
        """The run's noise generator (timesteps, noise)."""
        return self.rngs.generator

    def state_dict(self) -> dict[str, Any]:
        """Every part's state: plain values (JSON) and tensors (under "optimizer" and "rng")."""
        return {"step": self.step, "sampler": self.sampler.state_dict(),
                "counters": self.guard.state_dict(),
                "optimizer": {"groups": optimizer_groups(self.opt, self.names),
                              "tensors": optimizer_tensors(self.opt, self.names)},
                "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                "rng": self.rngs.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "validation": dict(self.validation)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`; this config's peak rates and schedule govern from the
        next step on (see `_configured_rates`)."""
        if self.ema is not None and state.get("ema") is None:
            raise CheckpointError("the checkpoint holds no EMA (its run had train.ema off); "
                                  "resume with train.ema.enabled = false, or start anew")
        configured = [g["initial_lr"] for g in self.opt.param_groups]  # this config's peaks
        load_optimizer(self.opt, self.names, state["optimizer"]["groups"],
                       state["optimizer"]["tensors"])
        self.sched.load_state_dict(state["scheduler"])
        _configured_rates(self.opt, self.sched, configured, self.train)
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.rngs.load_state_dict(state["rng"])
        self.sampler.load_state_dict(state["sampler"])
        self.guard.load_state_dict(state["counters"])
        self.step = int(state["step"])
        self.validation = dict(state.get("validation") or {})
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])

    def snapshot(self) -> Snapshot:
        """What a rescue checkpoint of the current step needs, taken before the next draws."""
        return Snapshot(self.step, self.sampler.epoch, self.sampler.position,
                        self.guard.state_dict(), self.generator.get_state(),
                        GlobalRngs.capture())

    def rewind(self, snap: Snapshot) -> None:
        """Back to `snap` (gradients dropped): the state a failed step started from."""
        self.opt.zero_grad(set_to_none=True)
        self.generator.set_state(snap.generator)
        snap.rngs.restore()
        self.guard.load_state_dict(snap.guard)
        self.sampler.load_state_dict({**self.sampler.state_dict(), "epoch": snap.epoch,
                                      "position": snap.position})
        self.step = snap.step


def _configured_rates(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                      configured: list[float], train: TrainConfig) -> None:
    """This config's peak rates and schedule govern from the next step on: a changed lr (any
    group's), step count or schedule takes effect; an unchanged config recomputes the very
    values the checkpoint holds (the same formula as the scheduler's)."""
    sched.base_lrs = list(configured)
    factor = lr_factor(sched.last_epoch, train)
    for group, base in zip(opt.param_groups, configured):
        group["initial_lr"] = base
        group["lr"] = base * factor


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter tensors by canonical name (`names`: id(param) -> name),
    where they live (the checkpoint writer moves them to the host shard by shard); its plain
    per-parameter values (step counts, Adafactor's first RMS) are in the groups."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"{names[id(p)]}{SEP}{key}"] = value.detach()
    return out


def optimizer_groups(opt: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's groups as JSON: hyper-parameters and the values some optimizers keep
    per group (Prodigy's d, schedule-free's weight_sum; JSON keeps a float's every bit),
    parameters by canonical name, and under "state" each parameter's plain (non-tensor)
    state values."""
    groups = []
    for group in opt.param_groups:
        entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                 if k != "params"}
        entry["params"] = [names[id(p)] for p in group["params"]]
        plain = {names[id(p)]: {k: v for k, v in opt.state.get(p, {}).items()
                                if not torch.is_tensor(v)} for p in group["params"]}
        entry[STATE] = {n: values for n, values in plain.items() if values}
        groups.append(entry)
    return groups


def load_optimizer(opt: torch.optim.Optimizer, names: dict[int, str],
                   groups: list[dict[str, Any]], tensors: dict[str, torch.Tensor]) -> None:
    """Put saved state back into an optimizer built for the same named parameters."""
    by_name = {names[id(p)]: p for g in opt.param_groups for p in g["params"]}
    saved = [n for g in groups for n in g["params"]]
    if sorted(saved) != sorted(by_name) or len(groups) != len(opt.param_groups):
        missing = sorted(set(saved) ^ set(by_name))[:5]
        raise CheckpointError(f"the checkpoint's optimizer holds other parameters than this run "
                              f"(first differences: {missing}); resume with the same adapter")
    opt.state.clear()
    for group, entry in zip(opt.param_groups, groups):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in entry.items()
                      if k not in ("params", STATE)})
        group["params"] = [by_name[n] for n in entry["params"]]
        for name, values in entry.get(STATE, {}).items():
            if name not in entry["params"] or not isinstance(values, dict):
                raise CheckpointError(f"the checkpoint's optimizer state names {name!r}, not "
                                      "a parameter of its group; the checkpoint is damaged")
            opt.state.setdefault(by_name[name], {}).update(values)
    for key, value in tensors.items():
        name, _, item = key.rpartition(SEP)
        param = by_name[name]
        # Checkpoints of format 1 saved plain numbers as 0-d int64 tensors (bitsandbytes and
        # these libraries keep "step" an int).
        plain = value.dim() == 0 and value.dtype == torch.int64
        opt.state.setdefault(param, {})[item] = int(value) if plain else value.to(param.device)
