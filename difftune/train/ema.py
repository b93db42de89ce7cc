"""An exponential moving average of the trained weights (`train.ema`), for any adapter type.

diffusers' `EMAModel` (diffusers.training_utils) holds the average and its decay schedule:
at the k-th EMA update (every `train.ema.every_n_steps` optimizer steps; skipped steps do not
count) each averaged weight moves as `ema -= (1 - d_k) * (ema - weight)` with
`d_1 = 0` (the first update takes the weights as they are) and, for k > 1,
`d_k = min(decay, (1 + (k - 1)) / (10 + (k - 1)))` (diffusers' ramp, so early weights do not
linger), or `d_k = decay` with `warmup = false`. With `cpu = true` the average lives in host
memory and is updated tensor by tensor (each weight copied to the host on its own: the same
arithmetic as EMAModel.step, which needs both on one device), so it costs no accelerator memory.

The average enters the model only around what asked for it (`use_for`: the saved files, the
samples), by swapping values tensor by tensor, and is swapped back at once: training always
continues from its own weights, and a checkpoint holds both (the average by canonical name in
`ema.safetensors`, sharded when large), so a resume continues both exactly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from difftune.config.sections import EmaConfig


class Ema:
    """The moving average of `params` (named by `names`: id(param) -> canonical name)."""

    def __init__(self, params: list[torch.nn.Parameter], names: dict[int, str],
                 cfg: EmaConfig) -> None:
        from diffusers.training_utils import EMAModel  # imported with the first EMA

        self.cfg, self.params = cfg, list(params)
        self.keys = [names[id(p)] for p in self.params]
        self.model = EMAModel(self.params, decay=cfg.decay,
                              min_decay=0.0 if cfg.warmup else cfg.decay)
        if cfg.cpu:
            self.model.to("cpu")

    def update(self, step: int) -> None:
        """Average in the weights after optimizer step `step`, when an update is due."""
        if step % self.cfg.every_n_steps:
            return
        if not self.cfg.cpu:
            self.model.step(self.params)
            return
        m = self.model
        m.optimization_step += 1
        m.cur_decay_value = decay = m.get_decay(m.optimization_step)
        with torch.no_grad():
            for shadow, p in zip(m.shadow_params, self.params):
                shadow.sub_((1 - decay) * (shadow - p.detach().to(shadow.device)))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the duration (swapped one tensor at a time,
        then swapped back bit for bit)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        with torch.no_grad():
            for shadow, p in zip(self.model.shadow_params, self.params):
                held = p.detach().clone()
                p.copy_(shadow.to(p.device))
                shadow.copy_(held.to(shadow.device))

    def state_dict(self) -> dict[str, Any]:
        """Plain values (JSON) and the averaged tensors by canonical name."""
        plain = {k: v for k, v in self.model.state_dict().items() if k != "shadow_params"}
        return {"plain": plain, "tensors": dict(zip(self.keys, self.model.shadow_params))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` (the averages put where this run keeps them)."""
        tensors = state["tensors"]
        missing = sorted(set(self.keys) ^ set(tensors))[:3]
        if missing:
            from difftune.errors import CheckpointError
            raise CheckpointError(f"the checkpoint's EMA holds other weights than this run "
                                  f"(first differences: {missing}); resume with the same adapter")
        device = "cpu" if self.cfg.cpu else None
        shadows = [tensors[k].to(device or p.device, p.dtype)
                   for k, p in zip(self.keys, self.params)]
        plain = dict(state["plain"])
        plain.update(decay=self.cfg.decay, min_decay=0.0 if self.cfg.warmup else self.cfg.decay)
        self.model.load_state_dict(plain | {"shadow_params": shadows})


@contextlib.contextmanager
def using(ema: Ema | None, purpose: str) -> Iterator[None]:
    """The EMA weights in the model when `purpose` ("saves", "samples") is in its use_for."""
    if ema is None or purpose not in ema.cfg.use_for:
        yield
        return
    with ema.applied():
        yield
