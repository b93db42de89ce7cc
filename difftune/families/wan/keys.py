"""Wan LoRA names: Wan's original module names (the default layout), the diffusers ones, and
the names other trainers write.

WanTransformer3DModel's modules map one to one onto Wan's own (`blocks.N.attn1.to_q` is
`blocks.N.self_attn.q`, `attn2` is `cross_attn`, `ffn.net.0.proj` is `ffn.0`, ...; diffusers'
convert_wan_transformer_to_diffusers renames them so), so no tensor is fused or split here.

The original layout (`diffusion_model.<Wan module>.lora_A/lora_B.weight`) is what ComfyUI maps
for Wan (its generic `diffusion_model.<state-dict name>` map, comfy/lora.py; it has no
diffusers-name table for WAN21) and what diffusers' WanLoraLoaderMixin converts
(_convert_non_diffusers_wan_lora_to_diffusers). That converter reads an `.alpha` entry for the
blocks' attention and FFN modules only; for the modules outside the blocks any `.alpha` would be
left over and refused, so theirs is folded into the up factor instead (both readers then apply
scale 1). Read back besides: musubi-tuner's `lora_unet_blocks_N_self_attn_q` (Wan's names,
dots as underscores, `lora_down`/`lora_up` and `.alpha`), ai-toolkit's and ComfyUI's
`diffusion_model.` keys (Wan's names or diffusers'), and the diffusers layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from difftune.adapters.formats import group_modules
from difftune.errors import CheckpointError
from difftune.families.wan.spec import BLOCK_NAMES, TOP_NAMES

# Model-spec architecture / implementation and kohya's (musubi-tuner's) base-model names, per
# variant.
ARCHITECTURE = {"2.1-t2v-1.3b": "wan-2.1-t2v-1.3b", "2.1-t2v-14b": "wan-2.1-t2v-14b",
                "2.2-t2v-a14b-low": "wan-2.2-t2v-a14b-low-noise",
                "2.2-t2v-a14b": "wan-2.2-t2v-a14b", "2.2-i2v-a14b": "wan-2.2-i2v-a14b",
                "2.1-i2v-14b": "wan-2.1-i2v-14b"}
IMPLEMENTATION = {"2.1-t2v-1.3b": "https://github.com/Wan-Video/Wan2.1",
                  "2.1-t2v-14b": "https://github.com/Wan-Video/Wan2.1",
                  "2.2-t2v-a14b-low": "https://github.com/Wan-Video/Wan2.2",
                  "2.2-t2v-a14b": "https://github.com/Wan-Video/Wan2.2",
                  "2.2-i2v-a14b": "https://github.com/Wan-Video/Wan2.2",
                  "2.1-i2v-14b": "https://github.com/Wan-Video/Wan2.1"}
BASE_VERSION = {"2.1-t2v-1.3b": "wan21", "2.1-t2v-14b": "wan21", "2.2-t2v-a14b-low": "wan22",
                "2.2-t2v-a14b": "wan22", "2.2-i2v-a14b": "wan22", "2.1-i2v-14b": "wan21"}
NETWORK_MODULE = "networks.lora_wan"

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
UNDERSCORED = ("lora_unet_", "lycoris_")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight",
           ".lora_A.weight": ".lora_A.weight", ".lora_B.weight": ".lora_B.weight",
           ".alpha": ".alpha"}


def _rename(module: str, blocks: dict[str, str], top: dict[str, str]) -> str | None:
    """A module path renamed by the `blocks` table (the part after `blocks.N.`) or the `top`
    one (whole paths outside the blocks); None where neither names it."""
    m = _BLOCK.match(module)
    if m is None:
        return top.get(module)
    part = blocks.get(m.group(2))
    return None if part is None else f"blocks.{m.group(1)}.{part}"


def to_wan(module: str) -> str | None:
    """Wan's name of a diffusers module (`blocks.0.attn1.to_q` -> `blocks.0.self_attn.q`)."""
    return _rename(module, dict(BLOCK_NAMES), dict(TOP_NAMES))


def from_wan(module: str) -> str | None:
    """The diffusers name of one of Wan's modules (the inverse of `to_wan`)."""
    return _rename(module, {w: d for d, w in BLOCK_NAMES}, {w: d for d, w in TOP_NAMES})


def to_original(state: dict[str, torch.Tensor], rank: int, alpha: float,
                prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """diffusers-named LoRA -> `diffusion_model.<Wan module>.lora_A/B.weight`: the blocks'
    modules with their `.alpha`, the others with alpha / rank folded into the up factor (see
    the module docstring). A module with no Wan name raises `CheckpointError`."""
    out: dict[str, torch.Tensor] = {}
    pairs = group_modules(state, alpha)
    unnamed = sorted(m for m in pairs if to_wan(m.removeprefix(f"{prefix}.")) is None)
    if unnamed:
        raise CheckpointError(f"these LoRA modules have no name in Wan's original layout: "
                              f"{unnamed}; save with save.format = \"diffusers\" instead, or "
                              "leave them out of the LoRA targets")
    for module, pair in pairs.items():
        wan = to_wan(module.removeprefix(f"{prefix}."))
        base = f"diffusion_model.{wan}"
        up = pair.up
        if _BLOCK.match(str(wan)):
            out[f"{base}.alpha"] = torch.tensor(float(pair.alpha), dtype=torch.float32)
        else:
            up = up * (pair.alpha / pair.rank)
        out[f"{base}.lora_A.weight"] = pair.down.contiguous()
        out[f"{base}.lora_B.weight"] = up.contiguous()
    return out


def _split(key: str) -> tuple[str, str]:
    """(module, factor suffix in peft's names) of one file key; ("", key) if it has none."""
    for suffix, ours in FACTORS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], ours
    return "", key


def _underscored(name: str) -> str | None:
    """The diffusers name of one of Wan's modules with underscores for dots (musubi-tuner's
    `blocks_0_self_attn_q`), found through the name tables (no Wan name is ambiguous)."""
    m = re.fullmatch(r"blocks_(\d+)_(.+)", name)
    if m is None:
        return next((ours for ours, wan in TOP_NAMES if wan.replace(".", "_") == name), None)
    part = next((ours for ours, wan in BLOCK_NAMES if wan.replace(".", "_") == m[2]), None)
    return f"blocks.{m[1]}.{part}" if part is not None else None


def _names(modules: Iterable[str]) -> dict[str, str]:
    """{every name a file may give a module (diffusers', Wan's, both with underscores): its
    diffusers name}, over the denoiser's module names."""
    out: dict[str, str] = {}
    for module in modules:
        for name in (module, to_wan(module)):
            if name is not None:
                out[name] = out[name.replace(".", "_")] = module
    return out


def diffusers_names(tensors: dict[str, torch.Tensor], modules: Iterable[str],
                    prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A Wan LoRA in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the alpha of
    each module that has an `.alpha` entry: any of the layouts in the module docstring.
    `modules` are the denoiser's module names (underscored names are found by matching). A key
    that names no module of the model is kept under `<prefix>.` as given, for the caller's
    report of modules this model lacks."""
    known = _names(modules)
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in tensors.items():
        module, suffix = _split(key)
        for head in UNDERSCORED + PREFIXES:
            if module.startswith(head):
                module = module[len(head):]
                break
        found = known.get(module) or from_wan(module) or _underscored(module)
        name = f"{prefix}.{found or module}"
        if suffix == ".alpha":
            alphas[name] = float(value.item())
        else:
            out[name + suffix] = value
    return out, alphas


# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) has no Wan branch
# in comfy/lora.py model_lora_keys_unet: only its generic forms over Wan's own names
# (`diffusion_model.<name>`, `lora_unet_<name>`), so no diffusers-name form.
COMFYUI_FORMS: tuple = ()
# diffusers' WanLoraLoaderMixin reads PEFT names and Wan's own names under `diffusion_model.`
# (_convert_non_diffusers_wan_lora_to_diffusers). Its musubi-tuner converter
# (_convert_musubi_wan_lora_to_diffusers) reads `lora_unet_` files only when they hold every
# block's attention and FFN and nothing else, and fails on the whole file otherwise: not a
# per-module rule, so `lora_unet_` keys are counted as dropped (convert to Wan's names).
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "original", "", ""))
