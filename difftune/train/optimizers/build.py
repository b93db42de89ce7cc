"""Build the optimizer `train.optimizer` names, from its library (see specs.py for the table).

Each builder takes the parameter groups (a group may set its own lr), the lr, the shared
fields the optimizer reads (betas / eps / weight_decay, resolved by `specs.shared_value`) and
its typed `optimizer_args`, and returns the library's optimizer. Libraries are imported only
when their optimizer is chosen.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from difftune.config import TrainConfig
from difftune.train.optimizers.specs import OPTIMIZERS, Args, parse_args, shared_value

Groups = list[dict[str, Any]]
Builder = Callable[[Groups, float, dict[str, Any], Args], torch.optim.Optimizer]


def _adamw(groups: Groups, lr: float, shared: dict[str, Any], args: Args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, **shared)


def _adamw8bit(groups: Groups, lr: float, shared: dict[str, Any],
               args: Args) -> torch.optim.Optimizer:
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(groups, lr=lr, **shared, **args.model_dump())


def _lion8bit(groups: Groups, lr: float, shared: dict[str, Any],
              args: Args) -> torch.optim.Optimizer:
    import bitsandbytes

    return bitsandbytes.optim.Lion8bit(groups, lr=lr, **shared, **args.model_dump())


def _prodigy(groups: Groups, lr: float, shared: dict[str, Any],
             args: Args) -> torch.optim.Optimizer:
    from prodigyopt import Prodigy

    opts = args.model_dump()
    opts["growth_rate"] = opts["growth_rate"] or float("inf")  # unset: unbounded
    return Prodigy(groups, lr=lr, **shared, **opts)


def _adafactor(groups: Groups, lr: float, shared: dict[str, Any],
               args: Args) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    relative = args.relative_step  # type: ignore[attr-defined]
    opt = Adafactor(groups, lr=None if relative else lr, **shared, **args.model_dump())
    if relative:  # the library computes the step size; a number keeps the schedule's
        for group in opt.param_groups:  # bookkeeping working, and is never read
            group["lr"] = group["lr"] if group["lr"] is not None else lr
    return opt


def _schedulefree(groups: Groups, lr: float, shared: dict[str, Any],
                  args: Args, warmup: int = 0) -> torch.optim.Optimizer:
    from schedulefree import AdamWScheduleFree

    return AdamWScheduleFree(groups, lr=lr, warmup_steps=warmup, **shared, **args.model_dump())


def _came(groups: Groups, lr: float, shared: dict[str, Any], args: Args) -> torch.optim.Optimizer:
    from came_pytorch.CAME import CAME

    return CAME(groups, lr=lr, **shared, **args.model_dump())


def _lion(groups: Groups, lr: float, shared: dict[str, Any], args: Args) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(groups, lr=lr, **shared, **args.model_dump())


BUILDERS: dict[str, Builder] = {
    "adamw": _adamw, "adamw8bit": _adamw8bit, "prodigy": _prodigy, "adafactor": _adafactor,
    "schedulefree_adamw": _schedulefree, "came": _came, "lion": _lion, "lion8bit": _lion8bit,
}


def make_optimizer(params: list[torch.nn.Parameter] | Groups,
                   cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names over the trainable parameters (or parameter groups,
    each may set its own lr), with its options; with fused_backward (AdamW only) the variant
    that steps each parameter inside backward. Optimizers that keep separate evaluation
    weights (schedule-free) are put in training mode, ready to step."""
    spec = OPTIMIZERS[cfg.optimizer]
    args = parse_args(cfg.optimizer, cfg.optimizer_args)
    shared = {f: shared_value(cfg, f) for f in spec.takes}
    groups = params if params and isinstance(params[0], dict) else [{"params": list(params)}]
    if cfg.fused_backward:
        from difftune.memory.fused import FusedAdamW

        opt = FusedAdamW(groups, lr=cfg.lr, **shared)
        opt.clip = cfg.max_grad_norm
        opt.attach()
        return opt
    if spec.schedule(args) == "own_warmup":
        opt = _schedulefree(groups, cfg.lr, shared, args, warmup=cfg.warmup_steps)
    else:
        opt = BUILDERS[cfg.optimizer](groups, cfg.lr, shared, args)
    if callable(getattr(opt, "train", None)):
        opt.train()
    return opt
