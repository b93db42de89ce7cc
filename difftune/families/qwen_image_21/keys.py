"""Qwen-Image 2.1 LoRA names: the layouts other trainers write, read back as diffusers names, and
the model-spec and kohya metadata names other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, the module names of
QwenImage21Transformer2DModel) is the only layout written: QwenImage21Pipeline loads LoRAs through
diffusers' QwenImageLoraLoaderMixin, which reads it. No other trainer writes Qwen-Image 2.1
LoRAs yet; `families.common.diffusers_layout` reads the prefixes and factor names the
Qwen-Image trainers use for the same module names, for `--init-lora`.
"""

from __future__ import annotations

# Model-spec architecture / implementation and kohya's base-model names for Qwen-Image 2.1.
ARCHITECTURE = "qwen-image-2.1"
IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
BASE_VERSION = "qwen_image_21"
NETWORK_MODULE = "networks.lora_qwen_image_21"

# `difftune lora verify`'s rules (lora_tools.programs). The ComfyUI snapshot read (4f874c5e)
# has no Qwen-Image 2.1 model; these are the forms its Qwen-Image branch of comfy/lora.py
# model_lora_keys_unet reads over the model's own (diffusers) names, which 2.1's modules keep.
COMFYUI_FORMS = ("", "transformer.", "lycoris_")
# diffusers' QwenImageLoraLoaderMixin reads PEFT names, and the same names under
# `diffusion_model.` or `lora_unet_` (_convert_non_diffusers_qwen_lora_to_diffusers).
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "diffusers", "", ""),
                   ("lora_unet_", "diffusers", "", ""))
