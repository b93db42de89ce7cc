"""SD3 / SD3.5 LoRA key table: diffusers module names <-> kohya / ComfyUI names in the MMDiT layout.

kohya sd-scripts (networks/lora_sd3.py) and ComfyUI name SD3 LoRAs after Stability's original
MMDiT (`mmditx.py`) modules with dots turned into underscores:
`lora_unet_joint_blocks_0_x_block_attn_qkv`. Where diffusers splits a module the kohya one is
fused: `x_block.attn.qkv` is `attn.to_q/to_k/to_v`, `context_block.attn.qkv` is
`attn.add_q_proj/add_k_proj/add_v_proj` and SD3.5's `x_block.attn2.qkv` is `attn2.to_q/k/v`
(row order q, k, v, each as wide as the input). Fusing and splitting is done by
`difftune.adapters.formats`.

Output orderings (as `convert_sd3_transformer_checkpoint_to_diffusers` in diffusers'
single_file_utils treats the base weights): a block's `adaLN_modulation.1` emits the same chunks
as diffusers' `norm1.linear` / `norm1_context.linear`, except in the last block, whose context
block is "pre-only" and emits (shift, scale) where diffusers' `AdaLayerNormContinuous` emits
(scale, shift); the final layer's `adaLN_modulation.1` is swapped the same way against
`norm_out.linear`. Those up factors get their row halves swapped both ways. The last block's
context block has no `attn.proj` and no `mlp`, so the table leaves them out.

Not mapped (a LoRA on them raises `CheckpointError`): the patch embedding `x_embedder.proj`
(diffusers `pos_embed.proj`, a conv) and norm layers.

diffusers 0.42 has no reader for SD3 kohya/sd-scripts LoRAs: `SD3LoraLoaderMixin.lora_state_dict`
passes keys through unconverted and `lora_conversion_utils` has no SD3 converter, so these files
are for ComfyUI / Forge / sd-scripts; difftune reads them back with `kohya_to_diffusers`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from difftune.adapters.formats import LoraPair
from difftune.adapters.fused import fuse_loras, split_fused_lora, zero_lora
from difftune.errors import CheckpointError
from difftune.families.common.kohya import (KOHYA_PREFIX, KohyaNames, fused_from_kohya,
                                            fused_to_kohya, swapped)

NAMES = KohyaNames("SD3", "an", "MMDiT")
# How kohya sd-scripts names SD3 models in its LoRA files' metadata. Its
# `analyze_state_dict_state` (library/sd3_utils.py) tells the variants apart as here: no
# q/k norm is SD3 medium; with it, x-block self-attention layers mean SD3.5 medium, none SD3.5
# large; that model type is its `ss_base_model_version`. The model-spec architecture is
# "stable-diffusion-3" followed by the variant (library/sai_model_spec.py ARCH_SD3_M), written
# here as Stability names the models; kohya's implementation value for SD3 LoRAs is "diffusers".
VARIANTS = {"3-medium": "stable-diffusion-3-medium", "3-5-medium": "stable-diffusion-3-5-medium",
            "3-5-large": "stable-diffusion-3-5-large"}
NETWORK_MODULE = "networks.lora_sd3"
IMPLEMENTATION = "diffusers"


def variant(qk_norm: str | None, dual_attention_layers: tuple[int, ...] | list[int]) -> str:
    """kohya's SD3 model type of a transformer config (its `qk_norm`, `dual_attention_layers`)."""
    if qk_norm is None:
        return "3-medium"
    return "3-5-medium" if dual_attention_layers else "3-5-large"

# (MMDiT name inside joint_blocks.N, diffusers modules inside transformer_blocks.N).
BLOCK: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("x_block_attn_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("x_block_attn_proj", ("attn.to_out.0",)),
    ("x_block_attn2_qkv", ("attn2.to_q", "attn2.to_k", "attn2.to_v")),
    ("x_block_attn2_proj", ("attn2.to_out.0",)),
    ("x_block_mlp_fc1", ("ff.net.0.proj",)),
    ("x_block_mlp_fc2", ("ff.net.2",)),
    ("x_block_adaLN_modulation_1", ("norm1.linear",)),
    ("context_block_attn_qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("context_block_attn_proj", ("attn.to_add_out",)),
    ("context_block_mlp_fc1", ("ff_context.net.0.proj",)),
    ("context_block_mlp_fc2", ("ff_context.net.2",)),
    ("context_block_adaLN_modulation_1", ("norm1_context.linear",)),
)
NON_BLOCK: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("context_embedder", ("context_embedder",)),
    ("t_embedder_mlp_0", ("time_text_embed.timestep_embedder.linear_1",)),
    ("t_embedder_mlp_2", ("time_text_embed.timestep_embedder.linear_2",)),
    ("y_embedder_mlp_0", ("time_text_embed.text_embedder.linear_1",)),
    ("y_embedder_mlp_2", ("time_text_embed.text_embedder.linear_2",)),
    ("final_layer_linear", ("proj_out",)),
    ("final_layer_adaLN_modulation_1", ("norm_out.linear",)),
)
_BLOCK_RE = re.compile(r"^transformer_blocks\.(\d+)\.")
_KOHYA_BLOCK_RE = re.compile(r"^joint_blocks_(\d+)_")


@dataclass(frozen=True)
class Entry:
    """One MMDiT module, the diffusers modules that make it up (row order) and its row swap."""

    kohya: str
    modules: tuple[str, ...]
    swap: bool = False


def _entries(blocks: set[int], last: int) -> list[Entry]:
    """The table for the given block indices; `last` is the pre-only (last) block's index."""
    if blocks and max(blocks) > last:
        raise CheckpointError(
            f"the LoRA has block {max(blocks)} but the SD3 transformer has {last + 1} blocks; "
            "it was made for a different model."
        )
    out: list[Entry] = []
    for i in sorted(blocks):
        for name, modules in BLOCK:
            pre_only_swap = i == last and name == "context_block_adaLN_modulation_1"
            out.append(Entry(f"joint_blocks_{i}_{name}", tuple(f"transformer_blocks.{i}.{m}" for m in modules), pre_only_swap))
    return out + [Entry(k, m, k == "final_layer_adaLN_modulation_1") for k, m in NON_BLOCK]


# ---------------------------------------------------------------- diffusers -> kohya


def diffusers_to_kohya(
    state: dict[str, torch.Tensor], alpha: float | dict[str, float], rank: int, num_layers: int,
    prefix: str = "transformer",
) -> dict[str, torch.Tensor]:
    """Convert a diffusers-named SD3 LoRA (`transformer.<module>.lora_A.weight`) to kohya names.

    `num_layers` is the transformer's block count (`config.num_layers`): the last block is
    pre-only and its context modulation is row-swapped. Fused MMDiT modules get
    down = cat(A_i), up = block-diag(B_i) and alpha * k (same scale); untrained parts of a fused
    module are zero-filled. A module with no MMDiT name raises `CheckpointError`.
    """
    def entries(modules: Iterable[str]) -> list[Entry]:
        return _entries({int(m.group(1)) for k in modules if (m := _BLOCK_RE.match(k))},
                        num_layers - 1)

    return fused_to_kohya(state, alpha, rank, prefix, NAMES, entries, _fuse_entry)


def _fuse_entry(entry: Entry, pairs: dict[str, LoraPair], rank: int) -> LoraPair:
    """The single LoRA of one MMDiT module: fused (q, k, v rows) and row-swapped as needed."""
    present = [pairs[m] for m in entry.modules if m in pairs]
    if len(entry.modules) == 1:
        fused = present[0]
    else:
        # q, k and v all map the same input to equally many rows: fill untrained ones with zeros
        like, rows, alpha = present[0].down, present[0].up.shape[0], present[0].alpha
        fused = fuse_loras([pairs.get(m) or zero_lora(rank, like.shape[1], rows, like, alpha) for m in entry.modules])
    if entry.swap:
        fused = swapped(fused)
    return fused


# ---------------------------------------------------------------- kohya -> diffusers


def kohya_to_diffusers(
    state: dict[str, torch.Tensor], num_layers: int, prefix: str = "transformer"
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Read a kohya/ComfyUI SD3 LoRA back into diffusers names.

    Returns the diffusers tensors and each module's alpha (`<prefix>.<module>` -> alpha; a
    missing kohya alpha means alpha = rank). Fused modules are split exactly
    (`adapters.fused.split_fused_lora`); all-zero parts (padding) are left out. Any other key
    (text-encoder LoRAs, unknown layers) raises `CheckpointError`.
    """
    def table(names: Iterable[str]) -> dict[str, Entry]:
        blocks = {int(m.group(1)) for k in names if (m := _KOHYA_BLOCK_RE.match(k))}
        return {e.kohya: e for e in _entries(blocks, num_layers - 1)}

    return fused_from_kohya(state, prefix, NAMES, table, _split_entry, linear_only=True)


def _split_entry(entry: Entry, pair: LoraPair) -> dict[str, LoraPair]:
    """One MMDiT module's LoRA as diffusers modules, undoing the row swap where there is one."""
    if entry.swap:
        pair = swapped(pair)
    if len(entry.modules) == 1:
        return {entry.modules[0]: pair}
    if pair.up.shape[0] % len(entry.modules):
        raise CheckpointError(f"fused LoRA {KOHYA_PREFIX}{entry.kohya} has {pair.up.shape[0]} rows, not 3 equal parts.")
    width = pair.up.shape[0] // len(entry.modules)
    return dict(zip(entry.modules, split_fused_lora(pair, [width] * len(entry.modules))))

# `difftune lora verify`'s rules (lora_tools.programs). ComfyUI (4f874c5e) reads the diffusers
# names its MMDiT table (comfy/utils.py mmdit_to_diffusers) maps under these prefixes
# (comfy/lora.py model_lora_keys_unet, SD3 branch), besides its generic original-name map.
COMFYUI_FORMS = ("transformer.", "base_model.model.", "lora_transformer_", "lycoris_")
# diffusers' SD3LoraLoaderMixin reads PEFT names only.
DIFFUSERS_READS = (("transformer.", "diffusers", "", ""),)
# The original (MMDiT) names depend on the transformer's depth (the last block is pre-only),
# so `difftune lora convert` reads and writes them against a model config: a released one's
# (transformer/config.json of stabilityai/stable-diffusion-3.5-medium and -large; SD3 medium's
# names are 3.5 medium's without attn2), the first whose modules and widths fit the file, or
# `--base`'s.
_MMDIT = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16,
          "attention_head_dim": 64, "joint_attention_dim": 4096, "pooled_projection_dim": 2048,
          "qk_norm": "rms_norm"}
RELEASED_LAYOUTS: dict[str, dict[str, object]] = {
    "stable-diffusion-3.5-medium": {**_MMDIT, "num_layers": 24, "num_attention_heads": 24,
                                    "caption_projection_dim": 1536, "pos_embed_max_size": 384,
                                    "dual_attention_layers": list(range(13))},
    "stable-diffusion-3.5-large": {**_MMDIT, "num_layers": 38, "num_attention_heads": 38,
                                   "caption_projection_dim": 2432, "pos_embed_max_size": 192},
}


def single_file_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The transformer config of an original (MMDiT) single file's tensors (root removed;
    only shapes are read), for `difftune lora convert --base FILE`."""
    from difftune.families.sd3.files import sd3_config

    return sd3_config(sd)
