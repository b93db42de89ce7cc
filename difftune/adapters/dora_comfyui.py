"""DoRA files for ComfyUI's formula: magnitudes that give the trained weights there too.

peft and LyCORIS read a DoRA layer as W' = m * (W + dW) / ||W + dW||, the norm taken per
output row (what difftune trains, and what its standard file means). ComfyUI's
`weight_decompose` (comfy/weight_adapter/base.py, checked at Comfy-Org/ComfyUI a125cd84,
2025-10-12; Forge's backend copies it) divides an output-axis `dora_scale` by the BASE
weight's row norm instead: W'_c = s * (W + dW) / (||W|| + eps), eps being float32's machine
epsilon (ComfyUI patches weights in float32). The standard file there gives rows scaled by
||W + dW|| / ||W||.

The base weights are at hand when a run saves, so difftune also writes a file whose
magnitudes are s = m * (||W|| + eps) / ||W + dW||: under ComfyUI's formula it gives W' exactly
(at strength 1; strength t gives W + t (W' - W)). A quantized or fp8-stored base is
dequantized first, so W is the base the adapter was trained on. The file's metadata says
which formula it is for (`difftune.dora_formula`), and difftune's own readers refuse the
ComfyUI file (its magnitudes mean something else to peft and LyCORIS).
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.integrations import dequantize_module_weight

from difftune.adapters.lycoris_files import ADAPTER
from difftune.errors import CheckpointError
from difftune.files.names import COMFYUI_DORA

FORMULA_KEY = "difftune.dora_formula"
PEFT, COMFYUI = "peft", "comfyui"
# ComfyUI computes patches in float32 and adds this to the base row norm.
COMFYUI_EPS = torch.finfo(torch.float32).eps
COMFYUI_SOURCE = "Comfy-Org/ComfyUI a125cd84 comfy/weight_adapter/base.py weight_decompose"
NOTES = {
    PEFT: "dora_scale = m in W' = m (W + dW) / ||W + dW|| (row norms): peft, LyCORIS, "
          "diffusers, difftune. ComfyUI and Forge divide by ||W|| instead: load the "
          f"{COMFYUI_DORA} file there",
    COMFYUI: f"dora_scale for ComfyUI's formula W' = s (W + dW) / (||W|| + eps) "
             f"({COMFYUI_SOURCE}; Forge too): gives the trained weights in ComfyUI and Forge. "
             "Not for peft, LyCORIS, diffusers or difftune: use the file without the suffix",
}


def formula_keys(formula: str) -> dict[str, str]:
    """The metadata saying which DoRA formula a file's magnitudes are for."""
    return {FORMULA_KEY: formula, "difftune.dora_note": NOTES[formula]}


def comfyui_path(path: Path) -> Path:
    """`<stem>-comfyui.safetensors` beside `path` (`lora-step000010.safetensors` ->
    `lora-step000010-comfyui.safetensors`)."""
    return path.with_name(f"{path.stem}{COMFYUI_DORA}{path.suffix}")


def base_weight(layer: BaseTunerLayer, name: str) -> torch.Tensor:
    """The base weight under a peft layer as float32 values: dequantized (torchao, quanto,
    bitsandbytes) or cast up (fp8, half storage). A storage it cannot read is an error naming
    the module and the way out."""
    weight = dequantize_module_weight(layer.get_base_layer())
    plain = (torch.Tensor, torch.nn.Parameter)
    if type(weight) not in plain and callable(getattr(weight, "dequantize", None)):
        weight = weight.dequantize()  # optimum-quanto's tensors
    if type(weight) not in plain or not weight.is_floating_point():
        raise CheckpointError(
            f"DoRA module {name}: its base weight is stored as {type(weight).__name__} of "
            f"{weight.dtype}, which "
            "difftune cannot read back as numbers to write the ComfyUI DoRA file; set "
            "save.dora_comfyui = false (the standard file is still written)")
    return weight.detach().float()


def row_norms(weight: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each output row (Linear rows, Conv2d filters), shape (out, 1, ...)."""
    rows = weight.reshape(weight.shape[0], -1).double().norm(dim=1)
    return rows.reshape(weight.shape[0], *[1] * (weight.ndim - 1))


def comfyui_scale(layer: BaseTunerLayer, name: str) -> torch.Tensor:
    """The `dora_scale` that makes ComfyUI's formula give this layer's trained weight."""
    weight = base_weight(layer, name)
    delta = layer.get_delta_weight(ADAPTER).detach().double().reshape(weight.shape)
    magnitude = layer.lora_magnitude_vector[ADAPTER].weight.detach().double()
    magnitude = magnitude.reshape(weight.shape[0], *[1] * (weight.ndim - 1))
    base = row_norms(weight).float().double() + COMFYUI_EPS  # ComfyUI's float32 norm
    return (magnitude * base / row_norms(weight.double() + delta)).float()


def comfyui_tensors(layers: dict[str, BaseTunerLayer], tensors: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """The standard LyCORIS file's tensors with every `dora_scale` for ComfyUI's formula."""
    out = dict(tensors)
    with torch.no_grad():
        for name, layer in layers.items():
            key = f"{name}.dora_scale"
            if key in out:
                out[key] = comfyui_scale(layer, name).reshape(out[key].shape)
    return out


def refuse_comfyui_file(option: str, path: Path, meta: dict[str, str]) -> None:
    """Refuse the ComfyUI DoRA file where peft's or LyCORIS's formula would read it."""
    if meta.get(FORMULA_KEY) != COMFYUI:
        return
    standard = path.with_name(path.name.replace(COMFYUI_DORA + path.suffix, path.suffix))
    raise CheckpointError(
        f"{option} {path} is the ComfyUI DoRA file ({FORMULA_KEY} = \"{COMFYUI}\"): its "
        "magnitudes are for ComfyUI's formula and would give other weights here; use the "
        f"standard file of the same save, {standard.name}")
