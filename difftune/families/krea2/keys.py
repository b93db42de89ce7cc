"""Krea 2 LoRA names: diffusers <-> the original (Krea 2 reference / ComfyUI) module names, the
layouts other trainers write, and the names model sites give the model.

The original checkpoint names its modules `blocks.N.attn.wq|wk|wv|wo|gate`,
`blocks.N.mlp.gate|up|down`, `txtfusion.(layerwise|refiner)_blocks.N.(attn|mlp).*`, `first`,
`last.linear`, `tmlp.0|2`, `tproj.1`, `txtmlp.1|3`, `txtfusion.projector` (diffusers'
convert_krea2_transformer_checkpoint_to_diffusers and _convert_non_diffusers_krea2_lora_to_
diffusers map them onto Krea2Transformer2DModel). Files in that layout carry the
`diffusion_model.` prefix (the reference trainer, ComfyUI), `base_model.model.` (ai-toolkit's
PEFT files, no alpha) or kohya's `lora_unet_<name with underscores>` with `.alpha` entries.
"""

from __future__ import annotations

import re

import torch

# Model-spec architecture / implementation and kohya-style base-model names for Krea 2.
ARCHITECTURE = "krea-2"
IMPLEMENTATION = "https://github.com/krea-ai/krea-2"
BASE_VERSION = "krea2"
NETWORK_MODULE = "networks.lora"
# Whole-module renames (diffusers -> original) outside the blocks.
STANDALONE = {
    "img_in": "first", "final_layer.linear": "last.linear", "time_embed.linear_1": "tmlp.0",
    "time_embed.linear_2": "tmlp.2", "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1",
    "txt_in.linear_2": "txtmlp.3", "text_fusion.projector": "txtfusion.projector",
}
ATTENTION = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_out.0": "wo", "to_gate": "gate"}
FEED_FORWARD = ("gate", "up", "down")
_DIFFUSERS_BLOCK = re.compile(r"(transformer_blocks|text_fusion\.(?:layerwise|refiner)_blocks)"
                              r"\.(\d+)\.(?:attn\.(to_q|to_k|to_v|to_out\.0|to_gate)|ff\.(\w+))$")
_ORIGINAL_BLOCK = re.compile(r"(blocks|txtfusion\.(?:layerwise|refiner)_blocks)\.(\d+)\."
                             r"(?:attn\.(wq|wk|wv|wo|gate)|mlp\.(\w+))$")
_KOHYA_BLOCK = re.compile(r"(blocks|txtfusion_(?:layerwise|refiner)_blocks)_(\d+)_"
                          r"(?:attn_(wq|wk|wv|wo|gate)|mlp_(gate|up|down))$")
# Prefixes before original module names, and the factor names other tools use.
ORIGINAL_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "base_model.model.")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def original_module(name: str) -> str | None:
    """The original module name of a diffusers one (None: not a LoRA target Krea 2 has)."""
    if name in STANDALONE:
        return STANDALONE[name]
    m = _DIFFUSERS_BLOCK.match(name)
    if m is None:
        return None
    part, index, attn, ff = m.groups()
    if ff is not None and ff not in FEED_FORWARD:
        return None
    root = "blocks" if part == "transformer_blocks" else part.replace("text_fusion", "txtfusion")
    return f"{root}.{index}." + (f"attn.{ATTENTION[attn]}" if attn else f"mlp.{ff}")


def diffusers_module(name: str) -> str | None:
    """The diffusers module name of an original one (None: not an original module name)."""
    inverse = {v: k for k, v in STANDALONE.items()}
    if name in inverse:
        return inverse[name]
    m = _ORIGINAL_BLOCK.match(name)
    if m is None:
        return None
    part, index, attn, mlp = m.groups()
    if mlp is not None and mlp not in FEED_FORWARD:
        return None
    root = ("transformer_blocks" if part == "blocks"
            else part.replace("txtfusion", "text_fusion"))
    by_original = {v: k for k, v in ATTENTION.items()}
    return f"{root}.{index}." + (f"attn.{by_original[attn]}" if attn else f"ff.{mlp}")


def kohya_module(name: str) -> str | None:
    """The original module name of a kohya `lora_unet_` one (underscores for dots)."""
    for original in STANDALONE.values():
        if name == original.replace(".", "_"):
            return original
    m = _KOHYA_BLOCK.match(name)
    if m is None:
        return None
    part, index, attn, mlp = m.groups()
    return f"{part.replace('txtfusion_', 'txtfusion.')}.{index}." + (
        f"attn.{attn}" if attn else f"mlp.{mlp}")


def _split(key: str) -> tuple[str, str]:
    """(module, tail) of a LoRA key: the tail is `.lora_A.weight`, `.lora_B.weight` or
    `.alpha` (down/up names already renamed)."""
    for tail in (".lora_A.weight", ".lora_B.weight", ".alpha"):
        if key.endswith(tail):
            return key[: -len(tail)], tail
    return key, ""


def diffusers_names(tensors: dict[str, torch.Tensor], prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A Krea 2 LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the
    alpha of each module (`<prefix>.<module>`) that has an `.alpha` entry. Reads diffusers
    names with any of the known prefixes, original names (`diffusion_model.`,
    `base_model.model.`) and kohya `lora_unet_` names; other keys pass through unchanged."""
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    original: set[str] = set()
    for key, value in tensors.items():
        name = key
        for old, new in FACTORS.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        module, tail = _split(name)
        target = _module_of(module, prefix)
        if target is not None and tail:
            if original_module(module.split(".", 1)[-1]) is None:
                original.add(f"{prefix}.{target}")
            name = f"{prefix}.{target}{tail}"
        if tail == ".alpha":
            alphas[name[: -len(".alpha")]] = float(value.item())
        else:
            out[name] = value
    # Original-layout files without alpha (ai-toolkit's, the reference trainer's, ours) are
    # read at scale 1, as diffusers and ComfyUI read them: alpha = the module's rank.
    for module in original - set(alphas):
        down = out.get(f"{module}.lora_A.weight")
        if down is not None:
            alphas[module] = float(down.shape[0])
    return out, alphas


def _module_of(module: str, prefix: str) -> str | None:
    """The diffusers module name a file's module name stands for (None: unknown)."""
    if module.startswith("lora_unet_"):
        original = kohya_module(module[len("lora_unet_"):])
        return diffusers_module(original) if original is not None else None
    for start in (f"{prefix}.", *ORIGINAL_PREFIXES):
        if module.startswith(start):
            rest = module[len(start):]
            if original_module(rest) is not None:
                return rest
            return diffusers_module(rest)
    return None


def to_original(state: dict[str, torch.Tensor], rank: int, alpha: float
                ) -> dict[str, torch.Tensor]:
    """diffusers-named LoRA -> `diffusion_model.<original module>.lora_A/B.weight`, the layout
    of the Krea 2 reference trainer and ComfyUI. No `.alpha` entries (diffusers' converter
    refuses keys besides the factors), so the scale alpha / rank is folded into the up factors
    and readers apply scale 1, as they do without alpha."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, tail = _split(key)
        original = original_module(module.split(".", 1)[1]) if "." in module else None
        if original is None or tail not in (".lora_A.weight", ".lora_B.weight"):
            raise ValueError(f"{key} is not a Krea 2 transformer LoRA factor")
        if tail == ".lora_B.weight":
            value = value * (alpha / rank)
        out[f"diffusion_model.{original}{tail}"] = value.contiguous()
    return out

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names its Krea 2 table (comfy/utils.py krea2_to_diffusers) maps under these prefixes
# (comfy/lora.py model_lora_keys_unet, Krea2 branch), besides its generic original-name map.
COMFYUI_FORMS = ("diffusion_model.", "transformer.", "lycoris_", "")
# diffusers' Krea2LoraLoaderMixin reads PEFT names, and the original names under
# `diffusion_model.` or `base_model.model.` (_convert_non_diffusers_krea2_lora_to_diffusers).
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "original", "", ""),
                   ("base_model.model.", "original", "", ""))
