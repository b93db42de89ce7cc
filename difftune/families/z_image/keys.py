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
