"""Qwen-Image 2.1 LoRA names: the layouts other trainers write, read back as diffusers names, and
the model-spec and kohya metadata names other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, the module names of
QwenImage21Transformer2DModel) is the default: QwenImage21Pipeline loads LoRAs through diffusers'
QwenImageLoraLoaderMixin, which reads it completely. `save.format = "original"` writes the
original checkpoint's names under `diffusion_model.` (`to_original`: each block's gate and up
projections fused as the checkpoint fuses them), the form ComfyUI's generic key map reads for
every model it loads by its checkpoint's names (the snapshot read loads no 2.1 model yet).
No other trainer writes Qwen-Image 2.1 LoRAs yet; `families.common.diffusers_layout` reads the
prefixes and factor names the Qwen-Image trainers use for the same module names, and
`split_fused` the original layout, for `--init-lora`.
"""

from __future__ import annotations

import torch

from difftune.adapters.formats import LoraPair, group_modules
from difftune.adapters.fused import fuse_loras, split_fused_lora, zero_lora

# Model-spec architecture / implementation and kohya's base-model names for Qwen-Image 2.1.
ARCHITECTURE = "qwen-image-2.1"
IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
BASE_VERSION = "qwen_image_21"
NETWORK_MODULE = "networks.lora_qwen_image_21"

# `difftune lora verify`'s rules (lora_tools.programs). The ComfyUI snapshot read (4f874c5e)
# has no Qwen-Image 2.1 model: comfy/model_detection.py detects Qwen-Image by
# `txt_norm.weight`, which 2.1 lacks, and nothing else matches its single-stream blocks, so no
# key of a 2.1 LoRA applies there. Its Qwen-Image branch of comfy/lora.py
# model_lora_keys_unet reads the model's own (diffusers) names bare, under `transformer.` and
# as `lycoris_<name_>`: the forms a 2.1 branch would take, kept for when it has one.
COMFYUI_LOADS_NOTHING = ("ComfyUI (4f874c5e) loads no Qwen-Image 2.1 model (its model "
                         "detection knows Qwen-Image by txt_norm, which 2.1 lacks)")
COMFYUI_FORMS = ("", "transformer.", "lycoris_")
# diffusers' QwenImageLoraLoaderMixin reads PEFT names, and the same names under
# `diffusion_model.` (_convert_non_diffusers_qwen_lora_to_diffusers). Not `lora_unet_`: that
# converter's underscore table is Qwen-Image's, so 2.1's top-level modules (`modulation.1`,
# `txt_in.in_layer`, ...) and `img_mlp.gate_layer` come out under wrong names and the file
# fails as a whole (measured on the tiny flavor: no layer adapted).
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "diffusers", "", ""))

# The original checkpoint's one fused SwiGLU input projection per block (gate rows first), and
# the two diffusers modules it holds (diffusers' convert_qwen_image21_transformer_checkpoint_
# to_diffusers splits it; ComfyUI's generic key map reads `diffusion_model.<checkpoint name>`).
FUSED = "img_mlp.gate_up"
PARTS = ("img_mlp.gate_layer", "img_mlp.proj")


def _fused_module(module: str) -> tuple[str, int] | None:
    """(the fused module's name, the part's index) of a diffusers module that is one of a
    fused module's parts, else None."""
    for index, part in enumerate(PARTS):
        if module.endswith("." + part):
            return module[: -len(part)] + FUSED, index
    return None


def to_original(state: dict[str, torch.Tensor], rank: int, alpha: float,
                prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """diffusers-named LoRA -> `diffusion_model.<original checkpoint module>.lora_A/B.weight`:
    each block's gate and up LoRAs fused into one of `img_mlp.gate_up` (`fuse_loras`: exact; a
    part not trained is filled with a zero LoRA), each module's alpha / rank folded into its up
    factor and no `.alpha` entry (readers then apply scale 1)."""
    pairs = {m.removeprefix(prefix + "."): p.baked()
             for m, p in group_modules(state, alpha).items()}
    parts: dict[str, list[LoraPair | None]] = {}
    for module in [m for m in pairs if _fused_module(m) is not None]:
        fused, index = _fused_module(module)  # type: ignore[misc]
        parts.setdefault(fused, [None, None])[index] = pairs.pop(module)
    for fused, found in parts.items():
        like = next(p for p in found if p is not None)
        fill = zero_lora(like.rank, like.down.shape[1], like.up.shape[0], like.down,
                         float(like.rank))
        pairs[fused] = fuse_loras([p if p is not None else fill for p in found])
    out: dict[str, torch.Tensor] = {}
    for module, pair in sorted(pairs.items()):
        base = f"diffusion_model.{module}"
        out[f"{base}.lora_A.weight"] = pair.down.contiguous()
        out[f"{base}.lora_B.weight"] = (pair.up * (pair.alpha / pair.rank)).contiguous()
    return out


def split_fused(state: dict[str, torch.Tensor], alphas: dict[str, float]
                ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A LoRA in diffusers names whose `img_mlp.gate_up` modules (the original layout's) are
    split into the gate and up modules they hold (`split_fused_lora`: exact for what
    `to_original` writes, and for a LoRA trained on the fused module), with their alphas."""
    out, found = dict(state), dict(alphas)
    for key in [k for k in state if k.endswith(f".{FUSED}.lora_A.weight")]:
        module = key.removesuffix(".lora_A.weight")
        down, up = out.pop(key), out.pop(f"{module}.lora_B.weight")
        fused = LoraPair(down, up, found.pop(module, float(down.shape[0])))
        base = module.removesuffix(FUSED)
        for part, pair in zip(PARTS, split_fused_lora(fused, [up.shape[0] // 2] * 2)):
            out[f"{base}{part}.lora_A.weight"] = pair.down
            out[f"{base}{part}.lora_B.weight"] = pair.up
            found[base + part] = pair.alpha
    return out, found
