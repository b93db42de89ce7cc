"""Which family a LoRA file is for: the family whose module names fit most of its modules.

Families share names (Chroma's and SD3's are mostly FLUX.1's), so a tie is broken by what the
file's metadata says (`ss_base_model_version`, `modelspec.architecture`, matched against the
names the family's keys.py gives the model), then by the width of its released models
(`ModelSize.width`) among the file's input widths, then by the family with fewer names (the
more specific one); a tie the metadata does not settle is reported (`also_fits`).
"""

from __future__ import annotations

import torch

from difftune.errors import CheckpointError
from difftune.families import registry
from difftune.lora_tools.keys import DENOISER, Module, read_modules
from difftune.lora_tools.names import family_keys, family_names


def labels(name: str) -> set[str]:
    """The names kohya and the model spec give family `name` (its keys.py constants)."""
    keys = family_keys(name)
    found: set[str] = set()
    for constant in ("BASE_VERSION", "ARCHITECTURE"):
        value = getattr(keys, constant, None)
        found |= set(value.values()) if isinstance(value, dict) else {value} if value else set()
    return found


def _said(name: str, metadata: dict[str, str]) -> bool:
    """Whether the file's metadata names family `name`."""
    said = {metadata.get("ss_base_model_version", ""),
            metadata.get("modelspec.architecture", "").split("/")[0]}
    return bool(labels(name) & said)


def _widths(tensors: dict[str, torch.Tensor]) -> set[int]:
    """The input widths of a file's low-rank factors (`lora_down`/`lora_A` columns)."""
    return {int(t.shape[1]) for k, t in tensors.items()
            if k.endswith(("lora_down.weight", "lora_A.weight")) and t.ndim == 2}


def _width_fits(name: str, widths: set[int]) -> bool:
    """Whether a released model of family `name` has a hidden width among `widths`."""
    return any(size.width in widths for _, spec in registry.variant_specs(name)
               for size in spec.sizes)


def _size(name: str) -> int:
    """How many module names family `name` has (fewer: the more specific family)."""
    names = family_names(name)
    return len(names.diffusers.dotted) + len(names.original.dotted)


def detect(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: object,
           family: str | None = None) -> tuple[str, list[str], list[Module], list[str]]:
    """(family, the other families that fit as well, its modules, stray keys) of a file;
    `family` forces one. A file no family's names fit raises CheckpointError."""
    if family is not None:
        modules, stray = read_modules(tensors, family_names(family))
        return family, [], modules, stray
    scored = []
    widths = _widths(tensors)
    for name in registry.names():
        modules, stray = read_modules(tensors, family_names(name))
        hits = sum(m.part == DENOISER for m in modules)
        scored.append((hits, _said(name, metadata), _width_fits(name, widths), -_size(name),
                       name, modules, stray))
    best = max(s[0] for s in scored)
    if best == 0:
        raise CheckpointError(
            f"{path}: none of its modules is a denoiser module of a family difftune knows "
            f"({', '.join(registry.names())}); if it is one of them, pass --family NAME")
    top = sorted((s for s in scored if s[0] == best), key=lambda s: s[:4], reverse=True)
    chosen = top[0]
    others = [s[4] for s in top[1:]] if not chosen[1] else []
    return chosen[4], others, chosen[5], chosen[6]
