"""FLUX.2 LoRA names: the layouts read, and the model-spec and kohya names of the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, Flux2Transformer2DModel's module
names) is the only layout written: diffusers' Flux2LoraLoaderMixin reads it and ComfyUI maps
those names onto its own modules (see `flux2/spec.py`). Read besides: the same names under
`diffusion_model.` (ai-toolkit's PEFT files, without alpha) with `lora_down`/`lora_up` factors
and `.alpha` entries.
"""

from __future__ import annotations

import torch

# Model-spec architecture / implementation and kohya's base-model names, per variant.
ARCHITECTURE = {"klein": "flux-2-klein", "dev": "flux-2-dev"}
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"
BASE_VERSION = {"klein": "flux2_klein", "dev": "flux2_dev"}
NETWORK_MODULE = "networks.lora_flux2"
KOHYA_REFUSED = ("save.format = \"kohya\" is not written for model.family = \"flux2\": "
                 "ComfyUI and diffusers both read its diffusers layout; use save.format = "
                 "\"diffusers\"")
FOREIGN_PREFIXES = ("diffusion_model.", "model.diffusion_model.")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def diffusers_names(tensors: dict[str, torch.Tensor], prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A FLUX.2 LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the
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
