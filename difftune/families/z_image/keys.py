"""Z-Image LoRA names: the model-spec and kohya metadata names other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, the module names of
ZImageTransformer2DModel) is the only layout written: diffusers' ZImageLoraLoaderMixin reads
it, and ComfyUI maps those diffusers names onto its own (fused-qkv) modules through its
Z-Image key map, so no second layout is needed.
"""

from __future__ import annotations

# Model-spec architecture / implementation and kohya's base-model names for Z-Image.
ARCHITECTURE = "z-image"
IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"
BASE_VERSION = "z_image"
NETWORK_MODULE = "networks.lora"

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names its Z-Image table (comfy/utils.py z_image_to_diffusers) maps under these prefixes
# (comfy/lora.py model_lora_keys_unet, Lumina2 branch), besides its generic original-name map.
COMFYUI_FORMS = ("diffusion_model.", "transformer.", "lycoris_", "")
# diffusers' ZImageLoraLoaderMixin reads PEFT names, and the same names under
# `diffusion_model.` or `lora_unet_` (_convert_non_diffusers_z_image_lora_to_diffusers).
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "diffusers", "", ""),
                   ("lora_unet_", "diffusers", "", ""))
