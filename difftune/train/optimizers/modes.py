"""Optimizer-side hooks the loop calls without knowing which optimizer runs.

`eval_weights`: an optimizer that trains at one point and evaluates at another (schedule-free
AdamW: it steps at y and the weights to use are the average x) exposes `eval()` / `train()`,
which move the model's weights between the two. Sampling and writing LoRA files happen inside
`eval_weights`, so they see x; afterwards the training weights are put back bit for bit (the
library's `train()` interpolates back, which rounds: an exact copy is restored over it), so
sampling and saving never change the trajectory and a resumed run stays exact.

`step_lr`: the learning rate a step used, as the metrics report it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_DEPTH = "_difftune_eval_depth"


def has_eval_weights(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` keeps separate weights to evaluate with (it has eval() and train())."""
    return callable(getattr(opt, "eval", None)) and callable(getattr(opt, "train", None))


@contextmanager
def eval_weights(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Inside, `params` hold the optimizer's evaluation weights (nothing changes for
    optimizers without them); on leaving, the exact training weights again. Re-entrant."""
    if not has_eval_weights(opt) or getattr(opt, _DEPTH, 0):
        yield
        return
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
        opt.eval()
    setattr(opt, _DEPTH, 1)
    try:
        yield
    finally:
        setattr(opt, _DEPTH, 0)
        with torch.no_grad():
            opt.train()  # the library's own mode flags
            for p, value in zip(params, kept):
                p.copy_(value)


def step_lr(opt: torch.optim.Optimizer) -> float:
    """The lr of the first group's last step: the library's own record where it schedules
    inside the step (schedule-free's warm-up, Adafactor's relative step, Prodigy's lr times
    its estimated step size d), else the group's."""
    group = opt.param_groups[0]
    if "scheduled_lr" in group:  # schedule-free: lr times its own warm-up
        return float(group["scheduled_lr"])
    relative = getattr(opt, "_get_lr", None)
    if group.get("relative_step") and relative is not None:  # Adafactor
        state = opt.state.get(group["params"][0], {})
        return float(relative(group, state)) if "step" in state else 0.0
    if "d" in group and "d0" in group:  # Prodigy: lr multiplies its estimated step size d
        return float(group["lr"] * group["d"])
    return float(group["lr"])
