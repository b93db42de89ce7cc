"""One LoRA module's factors as the merge and extract verbs use them: (down, up, scale)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftune.errors import ConfigError
from difftune.lora_tools import kinds
from difftune.lora_tools.keys import Module

PAIRS = (("lora_down.weight", "lora_up.weight"), ("lora_A.weight", "lora_B.weight"),
         ("lora.down.weight", "lora.up.weight"))


@dataclass(frozen=True)
class Factors:
    """`scale * up @ down`: the update of one module (a conv's factors keep their shapes)."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float

    def delta(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The update in float32, shaped as the weight it changes."""
        product = self.up.float().flatten(1) @ self.down.float().flatten(1)
        return (self.scale * product).reshape(shape)

    def rows(self, start: int, stop: int) -> "Factors":
        """The update of output rows start:stop only."""
        return Factors(self.down, self.up[start:stop], self.scale)

    def swapped(self) -> "Factors":
        """The update with its two output halves swapped."""
        first, second = self.up.chunk(2, dim=0)
        return Factors(self.down, torch.cat([second, first]), self.scale)


def pair_of(module: Module) -> tuple[str, str] | None:
    """The module's (down, up) tensor names, or None where it has no LoRA pair."""
    return next((p for p in PAIRS if set(p) <= set(module.tensors)), None)


def factors(module: Module, weight: float, default_alpha: float | None, label: str
            ) -> Factors:
    """A LoRA/LoCon module's factors at `weight`; other kinds are refused (their update needs
    more than one product, or, for DoRA, the base weight's norm)."""
    kind, pair = kinds.kind(module.tensors), pair_of(module)
    if kind not in (kinds.LORA, kinds.LOCON) or pair is None:
        raise ConfigError(f"{label}: {module.key} is a {kind}; merge reads LoRA and LoCon "
                          "modules (load a LoHa, LoKr or DoRA with `difftune sample --lora` "
                          "or ComfyUI instead)")
    down, up = module.tensors[pair[0]], module.tensors[pair[1]]
    alpha = kinds.alpha(module.tensors, default_alpha)
    return Factors(down, up, weight * (alpha if alpha is not None else down.shape[0])
                   / down.shape[0])
