"""Two readings of a DoRA file's module, written here from the formulas (not from difftune's
writer): peft's / LyCORIS's and ComfyUI's. Tests compare them with the weights a run trained.

A module's file tensors: `lora_up.weight` (out, r[, 1, 1]), `lora_down.weight` (r, in[, k, k]),
`alpha` (readers scale the product by alpha / r) and `dora_scale` (out, 1[, 1, 1]).
"""

from __future__ import annotations

import torch

# ComfyUI's weight_decompose as read at Comfy-Org/ComfyUI commit
# a125cd84b054a57729b5eecab930ca9408719832 (2025-10-12), comfy/weight_adapter/base.py, with the
# LoRA product of comfy/weight_adapter/lora.py (alpha / lora_down's rows). It patches a float32
# copy of the base weight.
COMFYUI_COMMIT = "a125cd84b054a57729b5eecab930ca9408719832"


def file_delta(parts: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """dW = alpha / r * up @ down, in float64, shaped like the base weight."""
    up, down = parts["lora_up.weight"].double(), parts["lora_down.weight"].double()
    rank = down.shape[0]
    scale = float(parts["alpha"]) / rank if "alpha" in parts else 1.0
    return (scale * (up.reshape(up.shape[0], -1) @ down.reshape(rank, -1))).reshape(shape)


def _rows(weight: torch.Tensor) -> torch.Tensor:
    """Each output row's L2 norm, shaped to broadcast over the weight."""
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1)
    return norm.reshape(weight.shape[0], *[1] * (weight.ndim - 1))


def peft_weight(base: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """peft's (and LyCORIS's) DoRA: W' = m * (W + dW) / ||W + dW||, row norms (float64)."""
    adapted = base.double() + file_delta(parts, base.shape)
    magnitude = parts["dora_scale"].double().reshape(base.shape[0], *[1] * (base.ndim - 1))
    return magnitude * adapted / _rows(adapted)


def comfyui_weight(base: torch.Tensor, parts: dict[str, torch.Tensor],
                   strength: float = 1.0) -> torch.Tensor:
    """ComfyUI's DoRA (float32, as it patches): W_c = W + dW; an output-axis dora_scale
    (shape[0] == out) is divided by the BASE weight's row norm + eps (else W_c's input-axis
    norm); W' = W_c * scale / norm, blended with W by `strength`."""
    weight = base.float()
    calc = weight + file_delta(parts, base.shape).float()
    scale = parts["dora_scale"].float()
    if scale.shape[0] == calc.shape[0]:
        norm = _rows(weight)
    else:
        norm = _rows(calc.transpose(0, 1)).transpose(0, 1)
    calc = calc * (scale / (norm + torch.finfo(torch.float32).eps))
    return weight + strength * (calc - weight) if strength != 1.0 else calc


def modules_of(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{file module: {suffix: tensor}} of a LyCORIS-layout file's DoRA modules."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, suffix = key.partition(".")
        out.setdefault(module, {})[suffix] = value
    return {m: parts for m, parts in out.items() if "dora_scale" in parts}


def change_error(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> float:
    """The largest error of `got` against `want`, relative to the layer's trained change
    (max |want - W|): 0.2 means off by a fifth of what training changed."""
    change = (want.double() - base.double()).abs().max()
    return float((got.double() - want.double()).abs().max() / change)
