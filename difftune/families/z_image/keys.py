"""Z-Image LoRA names: the model-spec and kohya metadata names other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, the module names of
ZImageTransformer2DModel) is the only layout written: diffusers' ZImageLoraLoaderMixin reads
it, and ComfyUI maps those diffusers names onto its own (fused-qkv) modules through its
Z-Image key map, so no second layout is needed.
"""

from __future__ import annotations

import torch

# Model-spec architecture / implementation and kohya's base-model names for Z-Image.
ARCHITECTURE = "z-image"
IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"
BASE_VERSION = "z_image"
NETWORK_MODULE = "networks.lora"
KOHYA_REFUSED = ("save.format = \"kohya\" is not written for model.family = \"z_image\": "
                 "ComfyUI and diffusers both read its diffusers layout; use save.format = "
                 "\"diffusers\"")
# Prefixes other tools put before the diffusers module names, and their factor names.
FOREIGN_PREFIXES = ("diffusion_model.", "model.diffusion_model.")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def diffusers_names(tensors: dict[str, torch.Tensor], prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A Z-Image LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the
    alpha of each module (`<prefix>.<module>`) that has an `.alpha` entry."""
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in tensors.items():
        name = key
        for foreign in FOREIGN_PREFIXES:
            if name.startswith(foreign):
                name = f"{prefix}.{name[len(foreign):]}"
                break
        for old, new in FACTORS.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        if name.endswith(".alpha"):
            alphas[name[: -len(".alpha")]] = float(value.item())
        else:
            out[name] = value
    return out, alphas
