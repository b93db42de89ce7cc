"""What one module of a LoRA file is: its adapter kind, rank, alpha and strength.

Kinds by the tensors a module holds (LyCORIS's and PEFT's names): LoRA (`lora_down`/`lora_up`
or PEFT's `lora_A`/`lora_B`), LoCon (the same on a conv: 4-D factors), DoRA (a LoRA with a
magnitude: `dora_scale` or PEFT's `lora_magnitude_vector`), LoHa (`hada_*`), LoKr (`lokr_*`),
full diff (`diff`, `diff_b`, `set_weight`: the whole weight change). The scale every reader
applies is alpha / rank, rank being the low-rank factor's rows (LyCORIS's `dim`); a module
without alpha is read with alpha = rank, or with the alpha diffusers' adapter metadata states.
"""

from __future__ import annotations

import json
import math

import torch

LORA, LOCON, DORA, LOHA, LOKR, FULL = "LoRA", "LoCon", "DoRA", "LoHa", "LoKr", "full diff"
_DOWN = ("lora_down.weight", "lora_A.weight", "lora.down.weight")
_UP = ("lora_up.weight", "lora_B.weight", "lora.up.weight")
_RANKED = (*_DOWN, "hada_w1_b", "lokr_w1_b", "lokr_w2_b")


def kind(tensors: dict[str, torch.Tensor]) -> str:
    """The adapter kind one module's tensors (by reader name) make."""
    names = set(tensors)
    if any(n.startswith("hada_") for n in names):
        return LOHA
    if any(n.startswith("lokr_") for n in names):
        return LOKR
    if names & {"diff", "diff_b", "set_weight"}:
        return FULL
    if names & {"dora_scale", "lora_magnitude_vector"}:
        return DORA
    down = next((tensors[n] for n in _DOWN if n in tensors), None)
    return LOCON if down is not None and down.ndim == 4 else LORA


def rank(tensors: dict[str, torch.Tensor]) -> int | None:
    """The rank readers divide alpha by; None where there is none (whole LoKr, full diff)."""
    return next((int(tensors[n].shape[0]) for n in _RANKED if n in tensors), None)


def file_alpha(metadata: dict[str, str]) -> float | None:
    """The file-wide alpha diffusers reads (`lora_alpha` in its `lora_adapter_metadata`, one
    value for every component), else None. kohya's `ss_network_alpha` is a record only:
    readers take each module's `alpha` tensor, and rank where there is none."""
    try:
        packed = json.loads(metadata.get("lora_adapter_metadata", "{}"))
        alphas = {v for k, v in packed.items() if k.endswith("lora_alpha")}
        return float(alphas.pop()) if len(alphas) == 1 else None
    except (ValueError, TypeError, AttributeError):
        return None


def alpha(tensors: dict[str, torch.Tensor], default: float | None) -> float | None:
    """The module's alpha: its `alpha` tensor, else the file-wide `default`, else its rank."""
    if "alpha" in tensors:
        return float(tensors["alpha"].float().item())
    found = rank(tensors)
    return default if default is not None else (float(found) if found is not None else None)


def strength(tensors: dict[str, torch.Tensor], scale: float) -> float | None:
    """The size of a LoRA module's weight change, ||scale * up @ down||_F (None for kinds
    that are not one product). Computed through the rank x rank Gram matrices, never the
    full weight: ||U D||^2 = trace((U^T U)(D D^T))."""
    up = next((tensors[n] for n in _UP if n in tensors), None)
    down = next((tensors[n] for n in _DOWN if n in tensors), None)
    if up is None or down is None:
        return None
    u, d = up.float().flatten(1), down.float().flatten(1)
    if u.shape[1] != d.shape[0]:
        return None
    gram = (u.T @ u) * (d @ d.T)
    return abs(scale) * math.sqrt(max(float(gram.sum()), 0.0))
