"""Fused kohya / ComfyUI LoRA keys, written once for the families whose original modules fuse
several diffusers modules (FLUX.1's BFL layout, SD3's MMDiT layout).

kohya files store three tensors per original module (`lora_unet_<name>.lora_down.weight`,
`.lora_up.weight`, `.alpha`). A family's `keys.py` gives its table (which diffusers modules make
up each original module, and how their rows are ordered); grouping keys, checking ranks and
prefixes, writing the tensors, swapping (shift, scale) row halves and the two conversion loops
are the same for all of them and live here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from difftune.adapters.formats import LoraPair, group_modules, pairs_to_diffusers
from difftune.adapters.fused import is_zero
from difftune.errors import CheckpointError

KOHYA_PREFIX = "lora_unet_"
DOWN, UP, ALPHA = "lora_down.weight", "lora_up.weight", "alpha"
# Prefixes ComfyUI-style files put before the original module names (ComfyUI's own LoRA
# training and ai-toolkit write `diffusion_model.<original name>` PEFT keys for BFL models).
ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_FACTORS = {"lora_A.weight": DOWN, "lora_B.weight": UP, DOWN: DOWN, UP: UP, ALPHA: ALPHA}


@dataclass(frozen=True)
class KohyaNames:
    """How error messages name a family's kohya layout: `model` ("FLUX"), the article before it
    ("a"), and the original layout's name ("BFL")."""

    model: str
    article: str
    layout: str


def swap_scale_shift(up: torch.Tensor) -> torch.Tensor:
    """Swap the two row halves of an up factor: (shift, scale) <-> (scale, shift)."""
    first, second = up.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def swapped(pair: LoraPair) -> LoraPair:
    """The pair with its up factor's (shift, scale) row halves swapped."""
    return LoraPair(pair.down, swap_scale_shift(pair.up), pair.alpha)


def strip_prefix(pairs: dict[str, LoraPair], prefix: str, names: KohyaNames
                 ) -> dict[str, LoraPair]:
    """Drop `<prefix>.` from every module name; a module without it is an error."""
    wrong = sorted(k for k in pairs if not k.startswith(f"{prefix}."))
    if wrong:
        raise CheckpointError(f"LoRA modules outside '{prefix}.' cannot be written as "
                              f"{names.article} {names.model} kohya LoRA: {wrong}")
    return {k.removeprefix(f"{prefix}."): v for k, v in pairs.items()}


def kohya_tensors(name: str, pair: LoraPair) -> dict[str, torch.Tensor]:
    """The three tensors kohya stores per module; alpha as a float32 scalar."""
    base = KOHYA_PREFIX + name
    return {
        f"{base}.{DOWN}": pair.down.contiguous(),
        f"{base}.{UP}": pair.up.contiguous(),
        f"{base}.{ALPHA}": torch.tensor(float(pair.alpha), dtype=torch.float32),
    }


def has_original_prefix(state: dict[str, torch.Tensor]) -> bool:
    """Whether a LoRA file names the original modules with a `diffusion_model.` prefix."""
    return any(k.startswith(ORIGINAL_PREFIXES) for k in state)


def original_to_kohya(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`diffusion_model.<original.module>.lora_A/B.weight` (or `lora_down/up`, `.alpha`) keys
    renamed to the kohya keys of the same modules (`lora_unet_<original_module>.lora_down...`),
    so one reader serves both. A missing alpha stays missing: the kohya reader then takes
    alpha = rank (scale 1), which is what such files mean. Other keys are errors."""
    out: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    for key, value in state.items():
        prefix = next((p for p in ORIGINAL_PREFIXES if key.startswith(p)), None)
        kind = next((f for f in _FACTORS if key.endswith("." + f)), None)
        if prefix is None or kind is None:
            bad.append(key)
            continue
        module = key[len(prefix): -len(kind) - 1]
        out[f"{KOHYA_PREFIX}{module.replace('.', '_')}.{_FACTORS[kind]}"] = value
    if bad:
        raise CheckpointError("these keys are not `diffusion_model.<module>.lora_A/lora_B` "
                              f"LoRA keys: {sorted(bad)}")
    return out


def group_kohya(state: dict[str, torch.Tensor], names: KohyaNames, linear_only: bool = False
                ) -> dict[str, LoraPair]:
    """{original name without `lora_unet_`: LoraPair} from kohya keys; malformed keys are
    errors (and, with `linear_only`, factors that are not 2-D)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    bad: list[str] = []
    for key, value in state.items():
        base, _, kind = key.partition(".")
        if not base.startswith(KOHYA_PREFIX) or kind not in (DOWN, UP, ALPHA):
            bad.append(key)
            continue
        halves.setdefault(base.removeprefix(KOHYA_PREFIX), {})[kind] = value
    if bad:
        raise CheckpointError(
            f"these keys are not kohya {names.model} LoRA keys "
            f"(lora_unet_*.lora_down/lora_up/alpha): {sorted(bad)}"
        )
    pairs: dict[str, LoraPair] = {}
    for name, parts in halves.items():
        if DOWN not in parts or UP not in parts:
            raise CheckpointError(f"kohya LoRA entry {KOHYA_PREFIX}{name} lacks its lora_down "
                                  "or lora_up weight.")
        down = parts[DOWN]
        if linear_only and down.ndim != 2:
            raise CheckpointError(f"kohya LoRA entry {KOHYA_PREFIX}{name} is not a linear LoRA "
                                  f"(shape {tuple(down.shape)}).")
        alpha = float(parts[ALPHA].item()) if ALPHA in parts else float(down.shape[0])
        pairs[name] = LoraPair(down, parts[UP], alpha)
    return pairs


def fused_to_kohya(
    state: dict[str, torch.Tensor], alpha: float | dict[str, float], rank: int, prefix: str,
    names: KohyaNames, entries: Callable[[Iterable[str]], list[Any]],
    fuse: Callable[[Any, dict[str, LoraPair], int], LoraPair],
) -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA in kohya names: `entries(modules)` gives the table rows (each with
    `.kohya` and `.modules`) for the trained modules, `fuse` one row's single LoRA. A module
    that no row names raises `CheckpointError` rather than being dropped."""
    pairs = strip_prefix(group_modules(state, alpha), prefix, names)
    for module, pair in pairs.items():
        if pair.rank != rank:
            raise CheckpointError(f"LoRA module {module!r} has rank {pair.rank}, expected {rank}.")
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for entry in entries(pairs):
        if not any(m in pairs for m in entry.modules):
            continue
        fused = fuse(entry, pairs, rank)
        used.update(m for m in entry.modules if m in pairs)
        out.update(kohya_tensors(entry.kohya, fused))
    unmapped = sorted(set(pairs) - used)
    if unmapped:
        raise CheckpointError(
            f"these LoRA modules have no kohya/ComfyUI ({names.layout}) name: {unmapped}; save "
            "in the diffusers format instead, or leave them out of the LoRA targets."
        )
    return out


def fused_from_kohya(
    state: dict[str, torch.Tensor], prefix: str, names: KohyaNames,
    table: Callable[[Iterable[str]], dict[str, Any]],
    split: Callable[[Any, LoraPair], dict[str, LoraPair]], linear_only: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A kohya LoRA back in diffusers names (`<prefix>.<module>.lora_A/B.weight`) with each
    module's alpha: `table(names)` maps the file's original names to rows, `split` one row's
    LoRA to its diffusers modules. All-zero parts (padding for untrained parts) are left out;
    an entry the table lacks raises `CheckpointError`."""
    fused = group_kohya(state, names, linear_only)
    rows = table(fused)
    unknown = sorted(KOHYA_PREFIX + k for k in fused if k not in rows)
    if unknown:
        raise CheckpointError(f"these LoRA entries are not {names.model} transformer modules "
                              f"difftune knows: {unknown}")
    pairs: dict[str, LoraPair] = {}
    for name, pair in fused.items():
        for module, part in split(rows[name], pair).items():
            if not is_zero(part):
                pairs[f"{prefix}.{module}"] = part
    return pairs_to_diffusers(pairs)
