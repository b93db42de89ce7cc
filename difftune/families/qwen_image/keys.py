"""Qwen-Image LoRA names: the layouts other trainers write, read back as diffusers names, and
the model-spec and kohya metadata names other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, the module names of
QwenImageTransformer2DModel) is the only layout written: diffusers' QwenImageLoraLoaderMixin
reads it, and ComfyUI's LoRA key map for Qwen-Image reads the same module names (see spec.py),
so no second layout is needed. Read for `--init-lora`: that layout, ComfyUI-style prefixes
(`diffusion_model.`, `model.diffusion_model.`; ai-toolkit's PEFT keys without alpha),
`lora_down`/`lora_up` factors with `.alpha` entries, bare module names, and the underscored
names of kohya/musubi-tuner (`lora_unet_`) and SimpleTuner's LyCORIS files (`lycoris_`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Model-spec architecture / implementation and kohya's base-model names for Qwen-Image.
ARCHITECTURE = "qwen-image"
IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
BASE_VERSION = "qwen_image"
NETWORK_MODULE = "networks.lora_qwen_image"
KOHYA_REFUSED = ("save.format = \"kohya\" is not written for model.family = \"qwen_image\": "
                 "ComfyUI and diffusers both read its diffusers layout; use save.format = "
                 "\"diffusers\"")
FOREIGN_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# Underscored module names (`transformer_blocks_0_attn_to_q`): kohya/musubi-tuner's, and
# SimpleTuner's LyCORIS names, both of which ComfyUI reads for Qwen-Image.
UNDERSCORED = ("lora_unet_", "lycoris_")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def _module_and_suffix(key: str) -> tuple[str, str]:
    """A key split into its module part and its factor/alpha suffix."""
    for suffix in (".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight",
                   ".alpha"):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return key, ""


def diffusers_names(tensors: dict[str, torch.Tensor], modules: Iterable[str] = (),
                    prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A Qwen-Image LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the
    alpha of each module (`<prefix>.<module>`) that has an `.alpha` entry.

    `modules` are the transformer's module names, needed only for kohya's `lora_unet_` names
    (underscores are ambiguous: `transformer_blocks_0_attn_to_q` is found by matching).
    """
    names = set(modules)
    kohya = {m.replace(".", "_"): m for m in names}
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in tensors.items():
        module, suffix = _module_and_suffix(key)
        for under in UNDERSCORED:
            if module.startswith(under):
                flat = module[len(under):]
                module = f"{prefix}.{kohya.get(flat, flat)}"
        if module in names:  # bare module names, as ComfyUI also reads them
            module = f"{prefix}.{module}"
        for foreign in FOREIGN_PREFIXES:
            if module.startswith(foreign):
                module = f"{prefix}.{module[len(foreign):]}"
                break
        if suffix == ".alpha":
            alphas[module] = float(value.item())
        else:
            out[module + FACTORS.get(suffix, suffix)] = value
    return out, alphas
