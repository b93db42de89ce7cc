"""Chroma LoRA key table: diffusers module names <-> kohya / ComfyUI names in Chroma's original
(BFL-style) layout, and the names kohya gives Chroma in its files' metadata.

Chroma's original checkpoint keeps FLUX.1's module names (`double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1`, `img_in`, `txt_in`, `final_layer.linear`) without the per-block
modulation layers, which its "distilled guidance" approximator replaces. ComfyUI reads such
`lora_unet_<original name>` keys through its generic `diffusion_model.*` mapping
(comfy/lora.py `model_lora_keys_unet`), and, since its `model_base.Chroma` subclasses
`model_base.Flux`, also the diffusers names (`transformer.<module>`) through the Flux branch.
Fusing and splitting follow `families.common.block_table`.
"""

from __future__ import annotations

import torch

from difftune.families.common.block_table import (BFL_DOUBLE_BLOCK, BFL_SINGLE_BLOCK, BlockTable,
                                                  Row)
from difftune.families.common.kohya import KohyaNames, fused_from_kohya, fused_to_kohya

NAMES = KohyaNames("Chroma", "a", "Chroma original")
# How kohya sd-scripts names Chroma: `ss_base_model_version` (library/flux_utils.py
# MODEL_VERSION_CHROMA), `ss_network_module` (its FLUX-family LoRA module), and the model-spec
# architecture and implementation (library/sai_model_spec.py ARCH_FLUX_1_CHROMA, IMPL_CHROMA).
BASE_VERSION = "chroma"
NETWORK_MODULE = "networks.lora_flux"
ARCHITECTURE = "chroma"
IMPLEMENTATION = "https://huggingface.co/lodestones/Chroma"
# Chroma's blocks have no modulation layers of their own (a distilled guidance network makes
# the modulation), so its block rows are the BFL layout's common ones.
DOUBLE_BLOCK: tuple[Row, ...] = BFL_DOUBLE_BLOCK
SINGLE_BLOCK: tuple[Row, ...] = BFL_SINGLE_BLOCK
NON_BLOCK: tuple[Row, ...] = (
    ("img_in", (("x_embedder", 1),)),
    ("txt_in", (("context_embedder", 1),)),
    ("final_layer_linear", (("proj_out", 1),)),
)
# The final layer is written with its scale baked in (alpha = rank), as for FLUX.1, so readers
# that ignore final-layer alphas apply the same delta.
TABLE = BlockTable(
    blocks=(("transformer_blocks", "double_blocks", DOUBLE_BLOCK),
            ("single_transformer_blocks", "single_blocks", SINGLE_BLOCK)),
    non_block=NON_BLOCK,
    bake=frozenset({"final_layer_linear"}),
)


def diffusers_to_kohya(
    state: dict[str, torch.Tensor], alpha: float, rank: int, prefix: str = "transformer"
) -> dict[str, torch.Tensor]:
    """A diffusers-named Chroma LoRA in kohya names (fused modules as `block_table` fuses
    them); a module with no original name raises `CheckpointError` rather than being dropped."""
    return fused_to_kohya(state, alpha, rank, prefix, NAMES, TABLE.entries_for,
                          lambda entry, pairs, r: TABLE.fuse(entry, pairs, r, float(alpha)))


def kohya_to_diffusers(
    state: dict[str, torch.Tensor], prefix: str = "transformer"
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A kohya/ComfyUI Chroma LoRA back in diffusers names, with each module's alpha; keys
    that are not Chroma transformer LoRA keys raise `CheckpointError`."""
    return fused_from_kohya(state, prefix, NAMES, TABLE.table_for, TABLE.split)

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names its FLUX table (comfy/utils.py flux_to_diffusers) maps under these prefixes
# (comfy/lora.py model_lora_keys_unet, Flux branch), besides its generic original-name map.
COMFYUI_FORMS = ("transformer.", "lycoris_", "lora_transformer_", "")
# diffusers' ChromaLoraLoaderMixin reads PEFT names only.
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""),)
