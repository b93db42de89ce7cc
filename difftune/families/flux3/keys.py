"""FLUX.3 LoRA names: the diffusers layout, BFL's original names read back, and the names
other tools give the model.

The diffusers layout (`transformer.<module>.lora_A/B.weight`, Flux3Transformer2DModel's module
names) is the only layout written: Flux3LoraLoaderMixin (which Flux3ModularPipeline inherits)
reads it as it is. Read back besides (`diffusers_names`): other trainers' spellings of the same
names (`diffusion_model.`, `lora_unet_`, `lycoris_`, `lora_down`/`lora_up` with `.alpha`), and
BFL's original module names under `diffusion_model.` (what diffusers' converter
_convert_non_diffusers_flux3_lora_to_diffusers reads), mapped by `ORIGINAL_MODULES`. ComfyUI at
4f874c5e has no FLUX.3 model, so it reads none of them (`COMFYUI_LOADS_NOTHING`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from difftune.families.common.diffusers_layout import diffusers_names as plain_names

# Model-spec architecture / implementation and kohya's base-model names for FLUX.3.
ARCHITECTURE = "flux-3"
IMPLEMENTATION = "https://github.com/black-forest-labs/flux3"
BASE_VERSION = "flux3"
NETWORK_MODULE = "networks.lora"

# BFL's original module names -> diffusers' (regex, replacement), applied in order: the block
# renames of diffusers' LoRA converter, then those its single-file converter adds for the
# modules outside the blocks. BFL's final modulation (`final_layer.image.adaLN_modulation.1`,
# (shift, scale) where norm_out.linear is (scale, shift)) is not mapped.
ORIGINAL_MODULES: tuple[tuple[str, str], ...] = (
    (r"^content_mode_blocks\.", "mode_blocks."),
    (r"^single_blocks\.", "single_transformer_blocks."),
    (r"\.q_proj$", ".attn.to_q"), (r"\.k_proj$", ".attn.to_k"), (r"\.v_proj$", ".attn.to_v"),
    (r"\.attn_out$", ".attn.to_out.0"), (r"\.mlp_in$", ".ff.linear_in"),
    (r"\.mlp_out$", ".ff.linear_out"),
    (r"^emb_in\.", "x_embedders."), (r"^txt_in$", "context_embedder"),
    (r"^time_in\.in_layer$", "timestep_embedder.linear_1"),
    (r"^time_in\.out_layer$", "timestep_embedder.linear_2"),
    (r"^ref_time_in\.in_layer$", "target_timestep_embedder.linear_1"),
    (r"^ref_time_in\.out_layer$", "target_timestep_embedder.linear_2"),
    (r"^final_layer\.image\.linear$", "proj_out"),
    (r"\.lin$", ".linear"),
)

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI at 4f874c5e has no FLUX.3 model
# (nothing under comfy/ldm, comfy/model_detection.py or comfy/supported_models.py names it), so
# it loads no FLUX.3 checkpoint and no key of a FLUX.3 LoRA.
COMFYUI_LOADS_NOTHING = ("ComfyUI at 4f874c5e has no FLUX.3 model (comfy/model_detection.py does "
                         "not detect it), so it loads no FLUX.3 LoRA")
COMFYUI_FORMS: tuple[str, ...] = ()
# Flux3LoraLoaderMixin reads PEFT names as they are, and `diffusion_model.` files through
# _convert_non_diffusers_flux3_lora_to_diffusers (diffusers' names, and BFL's block module
# names; BFL's modules outside the blocks keep names the model lacks).
_CONVERTER_MISSES = (r"early_stream_modulations\..*|single_stream_modulations\..*|"
                     r"x_embedders\..*|context_embedder|(?:target_)?timestep_embedder\..*|"
                     r"proj_out|norm_out\.linear")
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""),
                   # ai-toolkit's PEFT names under `diffusion_model.`: the converter's block
                   # renames match no diffusers name, so they pass through unchanged
                   ("diffusion_model.", "diffusers", "", ""),
                   ("diffusion_model.", "original", _CONVERTER_MISSES,
                    "diffusers' FLUX.3 converter renames the blocks' modules only"))


def from_original(module: str) -> str:
    """The diffusers module name of a BFL original one (`ORIGINAL_MODULES`)."""
    for pattern, replacement in ORIGINAL_MODULES:
        module = re.sub(pattern, replacement, module)
    return module


def diffusers_names(tensors: dict[str, torch.Tensor], modules: Iterable[str],
                    prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A LoRA file's tensors in diffusers names and per-module alphas: the spellings
    `common.diffusers_layout.diffusers_names` reads, then any module the model lacks read as
    BFL's original name (`from_original`)."""
    names = set(modules)
    state, alphas = plain_names(tensors, names, prefix)
    head = prefix + "."

    def fixed(module: str) -> str:
        if not module.startswith(head) or module[len(head):] in names:
            return module
        return head + from_original(module[len(head):])

    def renamed(key: str) -> str:
        cut = key.rfind(".lora_")
        return key if cut < 0 else fixed(key[:cut]) + key[cut:]

    return ({renamed(k): v for k, v in state.items()}, {fixed(m): a for m, a in alphas.items()})
