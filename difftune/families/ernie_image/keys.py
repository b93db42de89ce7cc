"""ERNIE-Image LoRA names: the model-spec names other tools give the model, and the rules of
the programs that read its LoRA files.

ERNIE-Image has one naming: ErnieImageTransformer2DModel's module names
(`layers.N.self_attention.to_q`, `layers.N.mlp.gate_proj`, ...), which ComfyUI's own model
(comfy/ldm/ernie/model.py) and the single files (`ernie-image.safetensors`) keep as well. The
diffusers layout (`transformer.<module>.lora_A/B.weight`) is the only layout written: diffusers'
ErnieImageLoraLoaderMixin reads it, and so does ComfyUI (comfy/lora.py maps
`transformer.<weight name>` for its ErnieImage model, besides its generic
`diffusion_model.<name>` and `lora_unet_<name_>` maps).

Other trainers' files use the same module names with other prefixes and factor names:
ai-toolkit writes `diffusion_model.<module>.lora_A/B` (no alpha), OneTrainer's older files kept
its internal `lora_down`/`lora_up` names with `.alpha` entries (diffusers' mixin refuses those
`.alpha` keys, which is why such files loaded nowhere before the mixin existed), kohya-style
tools `lora_unet_<module_>`. `diffusers_layout.diffusers_names` reads them all back for
`--init-lora`.
"""

from __future__ import annotations

# Model-spec architecture / implementation and kohya's base-model names for ERNIE-Image.
ARCHITECTURE = "ernie-image"
IMPLEMENTATION = "https://github.com/baidu/ERNIE-Image"
BASE_VERSION = "ernie_image"
NETWORK_MODULE = "networks.lora"

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names under `transformer.` (its ErnieImage branch of comfy/lora.py model_lora_keys_unet), and
# its generic map reads `diffusion_model.<name>` and `lora_unet_<name_>`, the same names.
COMFYUI_FORMS = ("transformer.",)
# diffusers' ErnieImageLoraLoaderMixin.lora_state_dict: PEFT names under `transformer.`, and
# `diffusion_model.` (ai-toolkit) or `base_model.model.` (PEFT) swapped to `transformer.`;
# every key must contain "lora" (no `.alpha` entries), and no kohya converter is called.
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "diffusers", "", ""),
                   ("base_model.model.", "diffusers", "", ""))
