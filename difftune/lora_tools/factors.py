"""One adapter module's update as `merge` places it on a base weight: a LoRA's factors
(down, up, scale), or a LoHa's or LoKr's tensors made whole when merged (LyCORIS's formulas:
LoHa (w1_a @ w1_b) * (w2_a @ w2_b), LoKr kron(w1, w2), each factor whole or a product)."""

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

    @property
    def out_rows(self) -> int:
        """The output rows the update spans."""
        return int(self.up.shape[0])


def _product(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A LoKr factor: whole (`name`) or `name_a @ name_b`."""
    if name in parts:
        return parts[name].float()
    return parts[f"{name}_a"].float() @ parts[f"{name}_b"].float()


@dataclass(frozen=True)
class Whole:
    """A LoHa or LoKr update of a linear layer, made whole when placed, then its halves
    swapped and rows cut as `ops` say, in order."""

    parts: dict[str, torch.Tensor]
    kind: str
    scale: float
    ops: tuple[tuple[str, int, int], ...] = ()

    def _made(self) -> torch.Tensor:
        """The whole update (float32), with `ops` applied and the scale."""
        p = self.parts
        if self.kind == kinds.LOHA:
            made = ((p["hada_w1_a"].float() @ p["hada_w1_b"].float())
                    * (p["hada_w2_a"].float() @ p["hada_w2_b"].float()))
        else:
            made = torch.kron(_product(p, "lokr_w1"), _product(p, "lokr_w2"))
        for op, start, stop in self.ops:
            if op == "swap":
                first, second = made.chunk(2, dim=0)
                made = torch.cat([second, first])
            else:
                made = made[start:stop]
        return made * self.scale

    def delta(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The update in float32, shaped as the weight it changes."""
        return self._made().reshape(shape)

    def rows(self, start: int, stop: int) -> "Whole":
        """The update of output rows start:stop only."""
        return Whole(self.parts, self.kind, self.scale, self.ops + (("rows", start, stop),))

    def swapped(self) -> "Whole":
        """The update with its two output halves swapped."""
        return Whole(self.parts, self.kind, self.scale, self.ops + (("swap", 0, 0),))

    @property
    def out_rows(self) -> int:
        """The output rows the update spans."""
        rows = self._rows_whole()
        for op, start, stop in self.ops:
            if op == "rows":
                rows = len(range(rows)[start:stop])
        return rows

    def _rows_whole(self) -> int:
        """The rows of the whole update (before `ops`)."""
        p = self.parts
        if self.kind == kinds.LOHA:
            return int(p["hada_w1_a"].shape[0])
        return int(_product(p, "lokr_w1").shape[0] * _product(p, "lokr_w2").shape[0])


Update = Factors | Whole


def pair_of(module: Module) -> tuple[str, str] | None:
    """The module's (down, up) tensor names, or None where it has no LoRA pair."""
    return next((p for p in PAIRS if set(p) <= set(module.tensors)), None)


def factors(module: Module, weight: float, default_alpha: float | None, label: str
            ) -> Update:
    """A module's update at `weight`: a LoRA/LoCon's factors, a LoHa/LoKr (on a linear
    layer) made whole when placed; DoRA is refused (its update needs the base weight's norm),
    and so is a conv LoHa/LoKr or a Tucker factor (not written by the trainers merged here)."""
    kind, pair = kinds.kind(module.tensors), pair_of(module)
    if kind in (kinds.LOHA, kinds.LOKR) and all(
            t.ndim <= 2 for t in module.tensors.values()) and not any(
            n in module.tensors for n in ("hada_t1", "hada_t2", "lokr_t2")):
        rank = kinds.rank(module.tensors)
        alpha = kinds.alpha(module.tensors, default_alpha)
        scale = alpha / rank if rank and alpha is not None else 1.0
        return Whole(dict(module.tensors), kind, weight * scale)
    if kind not in (kinds.LORA, kinds.LOCON) or pair is None:
        raise ConfigError(f"{label}: {module.key} is a {kind}; merge reads LoRA, LoCon and "
                          "linear LoHa and LoKr modules (load a DoRA with `difftune sample "
                          "--lora` or ComfyUI instead)")
    down, up = module.tensors[pair[0]], module.tensors[pair[1]]
    alpha = kinds.alpha(module.tensors, default_alpha)
    return Factors(down, up, weight * (alpha if alpha is not None else down.shape[0])
                   / down.shape[0])
