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

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from difftune.adapters.formats import LoraPair
from difftune.adapters.fused import fuse_loras, split_fused_lora, zero_lora
from difftune.families.common.kohya import (KohyaNames, fused_from_kohya, fused_to_kohya,
                                            swapped)

NAMES = KohyaNames("FLUX", "a", "BFL")
# How kohya sd-scripts names FLUX.1 in its LoRA files' metadata: `ss_base_model_version`
# (library/flux_utils.py MODEL_VERSION_FLUX_V1), `ss_network_module` (its FLUX LoRA module),
# and the model-spec architecture and implementation (library/sai_model_spec.py
# ARCH_FLUX_1_DEV / ARCH_FLUX_1_SCHNELL / IMPL_FLUX). Guidance-distilled checkpoints are dev.
BASE_VERSION = "flux1"
NETWORK_MODULE = "networks.lora_flux"
ARCHITECTURE = {True: "flux-1-dev", False: "flux-1-schnell"}  # by `guidance_embeds`
IMPLEMENTATION = "https://github.com/black-forest-labs/flux"
# FLUX.1's MLP width is 4x the hidden size (mlp_ratio in BFL's code); needed to size the
# `proj_mlp` rows of a single block's fused `linear1` when that part was not trained.
MLP_RATIO = 4

# (BFL name, ((diffusers module, output rows as a multiple of the input width), ...)).
# Fused entries list their parts in BFL's row order. The width multiple is only used for parts
# that were not trained and must be filled with zeros, so only fused parts need it.
DOUBLE_BLOCK: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("img_attn_qkv", (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1))),
    ("img_attn_proj", (("attn.to_out.0", 1),)),
    ("txt_attn_qkv", (("attn.add_q_proj", 1), ("attn.add_k_proj", 1), ("attn.add_v_proj", 1))),
    ("txt_attn_proj", (("attn.to_add_out", 1),)),
    ("img_mlp_0", (("ff.net.0.proj", MLP_RATIO),)),
    ("img_mlp_2", (("ff.net.2", 1),)),
    ("txt_mlp_0", (("ff_context.net.0.proj", MLP_RATIO),)),
    ("txt_mlp_2", (("ff_context.net.2", 1),)),
    ("img_mod_lin", (("norm1.linear", 6),)),
    ("txt_mod_lin", (("norm1_context.linear", 6),)),
)
SINGLE_BLOCK: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("linear1", (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1), ("proj_mlp", MLP_RATIO))),
    ("linear2", (("proj_out", 1),)),
    ("modulation_lin", (("norm.linear", 3),)),
)
NON_BLOCK: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
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
# Up rows are (shift, scale) in BFL and (scale, shift) in diffusers.
SWAP_SCALE_SHIFT = frozenset({"final_layer_adaLN_modulation_1"})
# diffusers' kohya reader ignores these entries' alphas: write them with the scale baked in.
BAKE_SCALE = frozenset({"final_layer_adaLN_modulation_1", "final_layer_linear"})

_DOUBLE_RE = re.compile(r"^transformer_blocks\.(\d+)\.")
_SINGLE_RE = re.compile(r"^single_transformer_blocks\.(\d+)\.")


@dataclass(frozen=True)
class Entry:
    """One BFL module and the diffusers modules (with output-width multiples) that make it up."""

    kohya: str
    parts: tuple[tuple[str, int], ...]

    @property
    def modules(self) -> tuple[str, ...]:
        """The diffusers module names, in BFL row order."""
        return tuple(m for m, _ in self.parts)


def _entries(double: set[int], single: set[int]) -> list[Entry]:
    """The full table for the given double- and single-block indices, non-block layers last."""
    out: list[Entry] = []
    for i in sorted(double):
        out += [
            Entry(f"double_blocks_{i}_{k}", tuple((f"transformer_blocks.{i}.{m}", w) for m, w in p))
            for k, p in DOUBLE_BLOCK
        ]
    for i in sorted(single):
        out += [
            Entry(f"single_blocks_{i}_{k}", tuple((f"single_transformer_blocks.{i}.{m}", w) for m, w in p))
            for k, p in SINGLE_BLOCK
        ]
    return out + [Entry(k, p) for k, p in NON_BLOCK]


def _entries_for(modules: Iterable[str]) -> list[Entry]:
    """The table for the blocks the diffusers module names mention."""
    double = {int(m.group(1)) for k in modules if (m := _DOUBLE_RE.match(k))}
    single = {int(m.group(1)) for k in modules if (m := _SINGLE_RE.match(k))}
    return _entries(double, single)


def _table_for(names: Iterable[str]) -> dict[str, Entry]:
    """{BFL name: entry} for the blocks the kohya names (without `lora_unet_`) mention."""
    names = list(names)
    double = {int(m.group(1)) for k in names if (m := re.match(r"double_blocks_(\d+)_", k))}
    single = {int(m.group(1)) for k in names if (m := re.match(r"single_blocks_(\d+)_", k))}
    return {e.kohya: e for e in _entries(double, single)}


# ---------------------------------------------------------------- diffusers -> kohya


def diffusers_to_kohya(
    state: dict[str, torch.Tensor], alpha: float, rank: int, prefix: str = "transformer"
) -> dict[str, torch.Tensor]:
    """Convert a diffusers-named FLUX LoRA (`transformer.<module>.lora_A.weight`) to kohya names.

    Fused BFL modules get down = cat(A_i), up = block-diag(B_i) and alpha * k (same scale); parts
    of a fused module that were not trained are filled with zero LoRAs so the row layout is the
    full BFL one. A module with no BFL name raises `CheckpointError` rather than being dropped.
    """
    return fused_to_kohya(state, alpha, rank, prefix, NAMES, _entries_for,
                          lambda entry, pairs, r: _fuse_entry(entry, pairs, r, float(alpha)))


def _fuse_entry(entry: Entry, pairs: dict[str, LoraPair], rank: int, alpha: float) -> LoraPair:
    """The single LoRA of one BFL module, fused and reordered as that module expects."""
    present = [pairs[m] for m in entry.modules if m in pairs]
    if len(entry.parts) == 1:
        fused = present[0]
    else:
        like = present[0].down
        in_features = like.shape[1]
        parts = [pairs.get(m) or zero_lora(rank, in_features, w * in_features, like, alpha) for m, w in entry.parts]
        fused = fuse_loras(parts)
    if entry.kohya in SWAP_SCALE_SHIFT:
        fused = swapped(fused)
    if entry.kohya in BAKE_SCALE:
        fused = fused.baked()
    return fused


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
    return fused_from_kohya(state, prefix, NAMES, _table_for, _split_entry)


def _split_entry(entry: Entry, pair: LoraPair) -> dict[str, LoraPair]:
    """One BFL module's LoRA as diffusers modules, undoing the row swap of the final layer."""
    if entry.kohya in SWAP_SCALE_SHIFT:
        pair = swapped(pair)
    if len(entry.parts) == 1:
        return {entry.modules[0]: pair}
    in_features = pair.down.shape[1]
    dims = [w * in_features for _, w in entry.parts]
    return dict(zip(entry.modules, split_fused_lora(pair, dims)))
