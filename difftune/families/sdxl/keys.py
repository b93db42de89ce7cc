"""SDXL LoRA key table: diffusers module names <-> kohya / ComfyUI names in the original SGM layout.

kohya sd-scripts trains SDXL on its own copy of Stability's SGM UNet, so its LoRA files (and the
files ComfyUI, Forge and A1111 read) name UNet modules after that UNet, with dots turned into
underscores: `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`. Text-encoder modules
keep transformers' names behind `lora_te1_` (CLIP-L, diffusers `text_encoder`) and `lora_te2_`
(CLIP-G, diffusers `text_encoder_2`).

Every entry is a rename: no SDXL module is fused or split, so a conv LoRA (4-D `lora_down` /
`lora_up`, as peft and kohya both store it) passes through unchanged, and alphas keep their
meaning (scale = alpha / rank).

Where a diffusers block sits in the SGM numbering depends on the UNet config, so the block table is
derived from it (`UNetLayout.from_config`): SGM's `input_blocks` are conv_in, then per down block
`layers_per_block` (resnet[, attention]) layers and a downsampler (all but the last block);
`middle_block` is resnet, attention, resnet; `output_blocks` are per up block
`layers_per_block + 1` (resnet[, attention]) layers, the upsampler sitting in the block's last
layer after its resnet and attention. Inside a block the names differ only for resnets
(`in_layers.2` = conv1, `emb_layers.1` = time_emb_proj, `out_layers.3` = conv2,
`skip_connection` = conv_shortcut), downsamplers (`op` = conv) and the top-level layers; the
transformer models (proj_in/out, transformer_blocks.N.attn1/attn2/ff) share diffusers' names.

Text encoders: kohya always writes `lora_teN_text_model_encoder_layers_...`. transformers 5's
CLIPTextModel has no `text_model.` level (CLIPTextModelWithProjection still has), so diffusers
names from it lack the root; `diffusers_to_kohya` accepts both, and `kohya_to_diffusers` writes
the root each model uses (`families.common.text.clip_root`). diffusers' own loader strips
`text_model.` itself when the encoder lacks it.

Checked against diffusers 0.42: `StableDiffusionXLPipeline.lora_state_dict(..., unet_config=...)`
reads every linear and conv layer of these files (attention, feed-forward, proj_in/out, resnets,
down/upsamplers, time/add embeddings, conv_in/out, both CLIPs) with their alphas, warning-free.

Known diffusers limitation (0.42): its SGM remapper (`_maybe_map_sgm_blocks_to_diffusers`) finds
the keys of `input_blocks_1` by substring, so for UNets with 10 or more input/output blocks (not
SDXL, which has 9) it would mix up blocks 1 and 10-19; it also needs an int `layers_per_block`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from difftune.errors import CheckpointError
from difftune.families.common.unet_keys import (KOHYA_UNET, UNET_COMFYUI_FORMS,
                                                UNET_FORGE_READS, lora_from_kohya,
                                                lora_to_kohya, translate)

# How kohya sd-scripts names SDXL in its LoRA files' metadata: `ss_base_model_version`
# (library/sdxl_model_util.py MODEL_VERSION_SDXL_BASE_V1_0), `ss_network_module`, and the
# model-spec architecture and implementation (library/sai_model_spec.py ARCH_SD_XL_V1_BASE,
# IMPL_STABILITY_AI).
BASE_VERSION = "sdxl_base_v1-0"
NETWORK_MODULE = "networks.lora"
ARCHITECTURE = "stable-diffusion-xl-v1-base"
IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
# diffusers component name -> kohya prefix for the two CLIP text encoders.
TEXT_ENCODERS = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}

# Inner names, (diffusers pattern, SGM pattern); "{n}" stands for a layer index.
_ATTN_LINEARS = tuple(
    f"transformer_blocks.{{n}}.{attn}.{proj}"
    for attn in ("attn1", "attn2")
    for proj in ("to_q", "to_k", "to_v", "to_out.0")
) + ("transformer_blocks.{n}.ff.net.0.proj", "transformer_blocks.{n}.ff.net.2", "proj_in", "proj_out")
INNER: dict[str, tuple[tuple[str, str], ...]] = {
    "resnet": (
        ("conv1", "in_layers.2"),
        ("time_emb_proj", "emb_layers.1"),
        ("conv2", "out_layers.3"),
        ("conv_shortcut", "skip_connection"),
    ),
    "attention": tuple((p, p) for p in _ATTN_LINEARS),
    "downsample": (("conv", "op"),),
    "upsample": (("conv", "conv"),),
}
TOP_LEVEL: tuple[tuple[str, str], ...] = (
    ("conv_in", "input_blocks.0.0"),
    ("time_embedding.linear_1", "time_embed.0"),
    ("time_embedding.linear_2", "time_embed.2"),
    ("add_embedding.linear_1", "label_emb.0.0"),
    ("add_embedding.linear_2", "label_emb.0.2"),
    ("conv_out", "out.2"),
)

# ---------------------------------------------------------------- the block layout


@dataclass(frozen=True)
class Block:
    """One diffusers sub-block (a resnet, attention model, down- or upsampler) and its SGM place."""

    diffusers: str  # e.g. "down_blocks.1.attentions.0"
    sgm: str  # e.g. "input_blocks.4.1"
    kind: str  # a key of INNER


@dataclass(frozen=True)
class UNetLayout:
    """Where every diffusers UNet sub-block sits in SGM's input/middle/output block numbering."""

    blocks: tuple[Block, ...]

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> UNetLayout:
        """Derive the layout from a `UNet2DConditionModel` config (the model's `.config` or a dict).

        Reads `down_block_types`, `up_block_types`, `layers_per_block` (int or per block) and
        `mid_block_type`; a block "has attention" when its type name contains "CrossAttn", as in
        diffusers' own block factory.
        """
        cfg = config if isinstance(config, Mapping) else dict(config)
        down_types = tuple(cfg["down_block_types"])
        up_types = tuple(cfg["up_block_types"])
        lpb = cfg.get("layers_per_block", 2)
        layers = [lpb] * len(down_types) if isinstance(lpb, int) else list(lpb)
        blocks = _down_blocks(down_types, layers) + _mid_blocks(cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn"))
        blocks += _up_blocks(up_types, list(reversed(layers)))
        return cls(tuple(blocks))

    def to_sgm(self, module: str) -> str:
        """The SGM name of a diffusers UNet module (dotted), or CheckpointError if it has none."""
        for diffusers, sgm in TOP_LEVEL:
            if module == diffusers:
                return sgm
        for block in self.blocks:
            if module.startswith(block.diffusers + "."):
                inner = translate(module[len(block.diffusers) + 1 :], INNER[block.kind], 0, 1, ".")
                if inner is not None:
                    return f"{block.sgm}.{inner}"
        raise CheckpointError(f"UNet module {module!r} has no kohya/SGM name difftune knows.")

    def kohya(self, module: str) -> str:
        """The kohya name (without `lora_unet_`) of a diffusers UNet module: its SGM name."""
        return self.to_sgm(module).replace(".", "_")

    def from_kohya(self, name: str) -> str:
        """The diffusers module of a kohya UNet name without `lora_unet_` (underscored SGM name)."""
        for diffusers, sgm in TOP_LEVEL:
            if name == sgm.replace(".", "_"):
                return diffusers
        for block in self.blocks:
            head = block.sgm.replace(".", "_") + "_"
            if name.startswith(head):
                inner = translate(name[len(head) :], INNER[block.kind], 1, 0, "_")
                if inner is not None:
                    return f"{block.diffusers}.{inner}"
        raise CheckpointError(f"kohya UNet entry {KOHYA_UNET}{name} is not a module of this SDXL UNet.")


def _has_attention(block_type: str | None) -> bool:
    """diffusers' block types with cross-attention transformers all carry "CrossAttn" in the name."""
    return block_type is not None and "CrossAttn" in block_type


def _down_blocks(types: tuple[str, ...], layers: list[int]) -> list[Block]:
    """input_blocks: 0 is conv_in; then each down block's layers, then its downsampler."""
    out: list[Block] = []
    index = 1
    for b, (kind, n) in enumerate(zip(types, layers)):
        for j in range(n):
            out.append(Block(f"down_blocks.{b}.resnets.{j}", f"input_blocks.{index}.0", "resnet"))
            if _has_attention(kind):
                out.append(Block(f"down_blocks.{b}.attentions.{j}", f"input_blocks.{index}.1", "attention"))
            index += 1
        if b < len(types) - 1:  # diffusers: add_downsample = not is_final_block
            out.append(Block(f"down_blocks.{b}.downsamplers.0", f"input_blocks.{index}.0", "downsample"))
            index += 1
    return out


def _mid_blocks(mid_type: str | None) -> list[Block]:
    """middle_block: resnet 0, attention, resnet 1 (UNetMidBlock2DCrossAttn, as in SDXL)."""
    if mid_type is None:
        return []
    if not _has_attention(mid_type):
        raise CheckpointError(f"mid block type {mid_type!r} has no SGM layout difftune knows (SDXL uses a CrossAttn one).")
    return [
        Block("mid_block.resnets.0", "middle_block.0", "resnet"),
        Block("mid_block.attentions.0", "middle_block.1", "attention"),
        Block("mid_block.resnets.1", "middle_block.2", "resnet"),
    ]


def _up_blocks(types: tuple[str, ...], layers: list[int]) -> list[Block]:
    """output_blocks: each up block's layers + 1; the upsampler follows resnet (and attention)."""
    out: list[Block] = []
    index = 0
    for b, (kind, n) in enumerate(zip(types, layers)):
        attention = _has_attention(kind)
        for j in range(n + 1):
            out.append(Block(f"up_blocks.{b}.resnets.{j}", f"output_blocks.{index}.0", "resnet"))
            if attention:
                out.append(Block(f"up_blocks.{b}.attentions.{j}", f"output_blocks.{index}.1", "attention"))
            if j == n and b < len(types) - 1:  # diffusers: add_upsample = not is_final_block
                out.append(Block(f"up_blocks.{b}.upsamplers.0", f"output_blocks.{index}.{2 if attention else 1}", "upsample"))
            index += 1
    return out


# ---------------------------------------------------------------- conversions


def diffusers_to_kohya(
    state: dict[str, torch.Tensor],
    alpha: float | dict[str, float],
    rank: int,
    layout: UNetLayout | Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """Convert an SDXL diffusers LoRA (`unet.` / `text_encoder.` / `text_encoder_2.` keys) to kohya.

    `alpha` is one value or a {`prefix.module`: alpha} dict; `layout` is a `UNetLayout` or the UNet
    config it is derived from. Every module must have both factors of rank `rank`. A module with no
    kohya name raises `CheckpointError` rather than being dropped.
    """
    layout = layout if isinstance(layout, UNetLayout) else UNetLayout.from_config(layout)
    return lora_to_kohya(state, alpha, rank, layout, TEXT_ENCODERS, "SDXL")


def kohya_to_diffusers(
    state: dict[str, torch.Tensor],
    layout: UNetLayout | Mapping[str, Any],
    text_roots: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Read a kohya/ComfyUI SDXL LoRA back into diffusers names (see
    `families.common.unet_keys.lora_from_kohya`); `layout` is a `UNetLayout` or its UNet config."""
    layout = layout if isinstance(layout, UNetLayout) else UNetLayout.from_config(layout)
    return lora_from_kohya(state, layout, TEXT_ENCODERS, text_roots, "SDXL")


# `difftune lora verify`'s rules (lora_tools.programs); ComfyUI's and Forge/A1111's are the
# UNet families' (common/unet_keys.py).
COMFYUI_FORMS = UNET_COMFYUI_FORMS
# diffusers' StableDiffusionXLLoraLoaderMixin reads PEFT names, and `lora_unet_` files in either
# naming through _convert_non_diffusers_lora_to_diffusers, whose renaming turns diffusers'
# `add_embedding` into `add.embedding`, a module the UNet lacks.
DIFFUSERS_READS = (
    ("unet.", "diffusers", "", ""),
    ("lora_unet_", "original", "", ""),
    ("lora_unet_", "diffusers", r"add_embedding\.linear_[12]", "diffusers' kohya converter "
     "renames add_embedding to add.embedding, which the UNet lacks"),
)
FORGE_READS = UNET_FORGE_READS
# The original (SGM) names depend on the UNet's layout, so `difftune lora convert` reads and
# writes them against a model config: the released one's (stabilityai/stable-diffusion-xl-base-1.0
# unet/config.json, the fields that differ from diffusers' defaults), or `--base`'s.
RELEASED_LAYOUTS: dict[str, dict[str, Any]] = {"stable-diffusion-xl-base-1.0": {
    "sample_size": 128, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D",
                                             "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [320, 640, 1280], "attention_head_dim": [5, 10, 20],
    "transformer_layers_per_block": [1, 2, 10], "cross_attention_dim": 2048,
    "use_linear_projection": True, "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816}}


def single_file_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The UNet config of an original (SGM) single file's UNet tensors (root removed; only
    shapes are read), for `difftune lora convert --base FILE`."""
    from difftune.families.sdxl.files import unet_config

    return unet_config(sd, None)
