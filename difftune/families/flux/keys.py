"""FLUX.1 LoRA key table: diffusers module names <-> kohya / ComfyUI names in BFL's layout.

kohya sd-scripts, ComfyUI and Forge name FLUX LoRAs after Black Forest Labs' original modules
(`lora_unet_double_blocks_0_img_attn_qkv`), where diffusers splits some of them: the fused
`img_attn.qkv` is three diffusers modules (`attn.to_q/to_k/to_v`) and a single block's `linear1`
is four (`attn.to_q/to_k/to_v` and `proj_mlp`, in that row order). Fusing and splitting is done
by `difftune.adapters.formats`; this module only says which names go together.

Output orderings: BFL's modulation layers (`img_mod.lin`, `txt_mod.lin`, `modulation.lin`) emit
(shift, scale, gate)[x2] exactly as diffusers' `norm1.linear` / `norm1_context.linear` /
`norm.linear` do, so they map without change. The final layer differs: BFL's
`final_layer.adaLN_modulation.1` emits (shift, scale) and diffusers' `norm_out.linear` emits
(scale, shift), so the up factor's two row halves are swapped both ways (as diffusers'
`swap_scale_shift` does when it reads kohya files).

Alphas: diffusers' kohya reader ignores the alpha of `final_layer_*` entries (it pops them
unused), so those two entries are written with the scale folded into `lora_up` and alpha equal
to the rank; every reader then applies the same delta.

Known diffusers limitations (as of diffusers 0.42), which do not affect ComfyUI / kohya:
- its reader splits `single_blocks_N_linear1` with the hard-coded full-size FLUX.1 row counts
  (3072, 3072, 3072, 12288), so it loads that entry only for full-size models;
- it names the converted non-block layers (`x_embedder`, `norm_out.linear`, `proj_out`, ...)
  without the `transformer.` prefix, so `load_lora_weights` silently skips them.
"""

from __future__ import annotations

import torch

from difftune.families.common.block_table import (BFL_DOUBLE_BLOCK, BFL_SINGLE_BLOCK, BlockTable,
                                                  Row)
from difftune.families.common.kohya import KohyaNames, fused_from_kohya, fused_to_kohya

NAMES = KohyaNames("FLUX", "a", "BFL")
# How kohya sd-scripts names FLUX.1 in its LoRA files' metadata: `ss_base_model_version`
# (library/flux_utils.py MODEL_VERSION_FLUX_V1), `ss_network_module` (its FLUX LoRA module),
# and the model-spec architecture and implementation (library/sai_model_spec.py
# ARCH_FLUX_1_DEV / ARCH_FLUX_1_SCHNELL / IMPL_FLUX). Guidance-distilled checkpoints are dev.
BASE_VERSION = "flux1"
NETWORK_MODULE = "networks.lora_flux"
ARCHITECTURE = {True: "flux-1-dev", False: "flux-1-schnell"}  # by `guidance_embeds`
IMPLEMENTATION = "https://github.com/black-forest-labs/flux"
# (BFL name, ((diffusers module, output rows as a multiple of the input width), ...)): the
# rows every BFL-layout model has, plus FLUX.1's modulation layers.
DOUBLE_BLOCK: tuple[Row, ...] = BFL_DOUBLE_BLOCK + (
    ("img_mod_lin", (("norm1.linear", 6),)),
    ("txt_mod_lin", (("norm1_context.linear", 6),)),
)
SINGLE_BLOCK: tuple[Row, ...] = BFL_SINGLE_BLOCK + (
    ("modulation_lin", (("norm.linear", 3),)),
)
NON_BLOCK: tuple[Row, ...] = (
    ("img_in", (("x_embedder", 1),)),
    ("txt_in", (("context_embedder", 1),)),
    ("time_in_in_layer", (("time_text_embed.timestep_embedder.linear_1", 1),)),
    ("time_in_out_layer", (("time_text_embed.timestep_embedder.linear_2", 1),)),
    ("guidance_in_in_layer", (("time_text_embed.guidance_embedder.linear_1", 1),)),
    ("guidance_in_out_layer", (("time_text_embed.guidance_embedder.linear_2", 1),)),
    ("vector_in_in_layer", (("time_text_embed.text_embedder.linear_1", 1),)),
    ("vector_in_out_layer", (("time_text_embed.text_embedder.linear_2", 1),)),
    ("final_layer_adaLN_modulation_1", (("norm_out.linear", 2),)),
    ("final_layer_linear", (("proj_out", 1),)),
)
# Up rows are (shift, scale) in BFL and (scale, shift) in diffusers; diffusers' kohya reader
# ignores the final layer's alphas, so those entries are written with the scale baked in.
TABLE = BlockTable(
    blocks=(("transformer_blocks", "double_blocks", DOUBLE_BLOCK),
            ("single_transformer_blocks", "single_blocks", SINGLE_BLOCK)),
    non_block=NON_BLOCK,
    swap=frozenset({"final_layer_adaLN_modulation_1"}),
    bake=frozenset({"final_layer_adaLN_modulation_1", "final_layer_linear"}),
)


# ---------------------------------------------------------------- diffusers -> kohya


def diffusers_to_kohya(
    state: dict[str, torch.Tensor], alpha: float, rank: int, prefix: str = "transformer"
) -> dict[str, torch.Tensor]:
    """Convert a diffusers-named FLUX LoRA (`transformer.<module>.lora_A.weight`) to kohya names.

    Fused BFL modules get down = cat(A_i), up = block-diag(B_i) and alpha * k (same scale); parts
    of a fused module that were not trained are filled with zero LoRAs so the row layout is the
    full BFL one. A module with no BFL name raises `CheckpointError` rather than being dropped.
    """
    return fused_to_kohya(state, alpha, rank, prefix, NAMES, TABLE.entries_for,
                          lambda entry, pairs, r: TABLE.fuse(entry, pairs, r, float(alpha)))


# ---------------------------------------------------------------- kohya -> diffusers


def kohya_to_diffusers(
    state: dict[str, torch.Tensor], prefix: str = "transformer"
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Read a kohya/ComfyUI FLUX LoRA back into diffusers names.

    Returns the diffusers tensors (`<prefix>.<module>.lora_A/B.weight`) and each module's alpha
    (`<prefix>.<module>` -> alpha; a missing kohya alpha means alpha = rank). Fused modules are
    split exactly (see `adapters.fused.split_fused_lora`); parts that are all zeros (the padding
    `diffusers_to_kohya` writes for untrained parts) are left out. Any key that is not a FLUX
    transformer LoRA key (text-encoder LoRAs, unknown layers) raises `CheckpointError`.
    """
    return fused_from_kohya(state, prefix, NAMES, TABLE.table_for, TABLE.split)

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names its FLUX table (comfy/utils.py flux_to_diffusers) maps under these prefixes
# (comfy/lora.py model_lora_keys_unet, Flux branch), besides its generic original-name map.
COMFYUI_FORMS = ("transformer.", "lycoris_", "lora_transformer_", "")
# diffusers' FluxLoraLoaderMixin reads PEFT names, and kohya's original-name files through
# _convert_kohya_flux_lora_to_diffusers, which names the layers outside the blocks without the
# `transformer.` prefix (so they are skipped) and splits `single_blocks_N_linear1` by the
# full-size model's row counts (a smaller model's file fails to load).
_OUTSIDE_BLOCKS = (r"x_embedder|context_embedder|norm_out\.linear|proj_out|"
                   r"time_text_embed\..*")
DIFFUSERS_READS = (
    ("transformer.", "diffusers", "", ""),
    ("lora_unet_", "original", _OUTSIDE_BLOCKS, "diffusers' kohya FLUX converter names the "
     "layers outside the blocks without the transformer. prefix; its loader skips them"),
)
