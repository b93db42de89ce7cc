"""Qwen-Image LoRA names: the layouts other trainers write, read back as diffusers names, and
the model-spec and kohya metadata names other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, the module names of
QwenImageTransformer2DModel) is the only layout written: diffusers' QwenImageLoraLoaderMixin
reads it, and ComfyUI's LoRA key map for Qwen-Image reads the same module names (see spec.py),
so no second layout is needed; `families.common.diffusers_layout` reads the other trainers'
layouts of the same names for `--init-lora`.
"""

from __future__ import annotations

# Model-spec architecture / implementation and kohya's base-model names for Qwen-Image.
ARCHITECTURE = "qwen-image"
IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
BASE_VERSION = "qwen_image"
NETWORK_MODULE = "networks.lora_qwen_image"

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the model's
# own names (diffusers') under these prefixes (comfy/lora.py model_lora_keys_unet, QwenImage
# branch), besides its generic map.
COMFYUI_FORMS = ("", "transformer.", "lycoris_")
# diffusers' QwenImageLoraLoaderMixin reads PEFT names, and the same names under
# `diffusion_model.` or `lora_unet_` (_convert_non_diffusers_qwen_lora_to_diffusers).
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "diffusers", "", ""),
                   ("lora_unet_", "diffusers", "", ""))
