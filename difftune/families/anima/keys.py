"""Anima LoRA names: the original (Cosmos-Predict2) module names, the default layout, and the
diffusers ones, both ways.

CosmosTransformer3DModel's linear layers map one to one onto the original DiT's
(`transformer_blocks.N.attn1.to_q` is `blocks.N.self_attn.q_proj`, `norm1.linear_1` is
`adaln_modulation_self_attn.1`, `ff.net.0.proj` is `mlp.layer1`, ...): the names diffusers'
_convert_non_diffusers_anima_lora_to_diffusers reads back, so no tensor is fused or split.

Written: `diffusion_model.<original module>.lora_A/lora_B.weight`, each module's alpha / rank
folded into its up factor (diffusers' Anima loader refuses `.alpha` keys; see spec.py). Read
back besides: the same with `.alpha` entries (ComfyUI's and diffusion-pipe's files), kohya-style
`lora_unet_<original name, dots as underscores>.lora_down/lora_up.weight` + `.alpha`
(sd-scripts' and musubi-tuner's naming), `lycoris_`/`transformer.` prefixes, and the diffusers
layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from difftune.adapters.formats import group_modules
from difftune.errors import CheckpointError
from difftune.families.anima.spec import BLOCK_NAMES, TOP_NAMES

# Model-spec architecture / implementation and kohya's base-model names for Anima.
ARCHITECTURE = "anima"
IMPLEMENTATION = "https://huggingface.co/circlestone-labs/Anima"
BASE_VERSION = "anima"
NETWORK_MODULE = "networks.lora_anima"

# The other weights (q/k RMSNorms, the time embedding's norm), for the single-file layout.
NORM_NAMES = (("attn1.norm_q", "self_attn.q_norm"), ("attn1.norm_k", "self_attn.k_norm"),
              ("attn2.norm_q", "cross_attn.q_norm"), ("attn2.norm_k", "cross_attn.k_norm"))
_BLOCK = dict(BLOCK_NAMES + NORM_NAMES)
_TOP = dict(TOP_NAMES + (("time_embed.norm", "t_embedding_norm"),))
# A LoRA key: a prefix other tools write, the module, the factor (or alpha).
_KEY = re.compile(r"^(model\.diffusion_model\.|diffusion_model\.|lora_unet_|lycoris_)?(.+?)"
                  r"(\.lora_[AB]\.weight|\.lora_(?:down|up)\.weight|\.alpha)$")


def to_original(module: str) -> str | None:
    """The original name of a diffusers module (`transformer_blocks.0.attn1.to_q` ->
    `blocks.0.self_attn.q_proj`); None where the tables do not name it."""
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module)
    if m is None:
        return _TOP.get(module)
    return f"blocks.{m[1]}.{_BLOCK[m[2]]}" if m[2] in _BLOCK else None


def original_layout(state: dict[str, torch.Tensor], rank: int, alpha: float,
                    prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """diffusers-named LoRA -> `diffusion_model.<original module>.lora_A/B.weight`, alpha /
    rank folded into the up factor. A module with no original name raises CheckpointError."""
    pairs = group_modules(state, alpha)
    unnamed = sorted(m for m in pairs if to_original(m.removeprefix(f"{prefix}.")) is None)
    if unnamed:
        raise CheckpointError(f"these LoRA modules have no name in Anima's original layout: "
                              f"{unnamed}; save with save.format = \"diffusers\" instead")
    out: dict[str, torch.Tensor] = {}
    for module, pair in pairs.items():
        base = f"diffusion_model.{to_original(module.removeprefix(f'{prefix}.'))}"
        out[f"{base}.lora_A.weight"] = pair.down.contiguous()
        out[f"{base}.lora_B.weight"] = (pair.up * (pair.alpha / pair.rank)).contiguous()
    return out


def diffusers_names(tensors: dict[str, torch.Tensor], modules: Iterable[str],
                    prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """An Anima LoRA in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the alpha of
    each module that has an `.alpha` entry, from any layout in the module docstring: keys in
    the original names (dotted, or underscored after `lora_unet_`) are renamed to diffusers'
    under `diffusion_model.`, then read as the diffusers-layout families read other trainers'
    files (`common.diffusers_layout.diffusers_names`). `modules` are the denoiser's module
    names. A key naming no module of the model (an LLM adapter's, `llm_adapter.*`) is kept
    under `<prefix>.`, for the caller's report of modules this model lacks."""
    from difftune.families.common.diffusers_layout import diffusers_names as read

    modules = list(modules)
    originals: dict[str, str] = {}
    for module in modules:
        if (name := to_original(module)) is not None:
            originals[name] = originals[name.replace(".", "_")] = module

    def renamed(key: str) -> str:
        m = _KEY.match(key)
        if m is None or m[2] not in originals:
            return key
        return f"diffusion_model.{originals[m[2]]}{m[3]}"

    return read({renamed(k): v for k, v in tensors.items()}, modules, prefix)


# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) has no Anima branch
# in comfy/lora.py model_lora_keys_unet: only its generic forms over the model's own names
# (`diffusion_model.<name>`, `lora_unet_<name>`), so no diffusers-name form.
COMFYUI_FORMS: tuple = ()
# diffusers' AnimaLoraLoaderMixin reads PEFT names and the original names under
# `diffusion_model.` (_convert_non_diffusers_anima_lora_to_diffusers; no `.alpha`). Its
# converter renames substrings of every `diffusion_model.` key, so diffusers' own names there
# (ai-toolkit's spelling) survive only outside the blocks: `blocks.` in
# `transformer_blocks.N` is renamed again.
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""), ("diffusion_model.", "original", "", ""),
                   ("diffusion_model.", "diffusers", r"transformer_blocks\..*",
                    "diffusers' Anima converter renames `blocks.` inside `transformer_blocks.`"))
