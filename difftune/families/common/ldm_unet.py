"""The original (LDM/SGM) UNet checkpoint layout, shared by the UNet families (SD 1.5, SDXL).

Stability's checkpoints (v1-5-pruned-emaonly.safetensors, sd_xl_base_1.0.safetensors) keep the
UNet under `model.diffusion_model.` in the LDM numbering: `input_blocks.<i>.<j>`,
`middle_block.<j>`, `output_blocks.<i>.<j>`. Reading one derives a `UNet2DConditionModel`
config from tensor shapes (the released model's values where shapes are silent, passed by the
family) and converts names with diffusers' own converter; writing one (a full fine-tune) maps
each diffusers tensor name back to that numbering.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import UNET_PREFIX, head_width, norm_groups
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  missing_error, prefixed)

if TYPE_CHECKING:
    from difftune.files.single import Layout


def _level_starts(n_levels: int, per_level: int) -> list[int]:
    """SGM input-block index of each level's first resnet (block 0 is conv_in)."""
    return [1 + level * (per_level + 1) for level in range(n_levels)]


def _depth(sd: dict[str, torch.Tensor], block: str) -> int:
    """Transformer depth of the SGM attention block `block` (0 when it has no attention)."""
    return count_blocks(sd, f"{block}.1.transformer_blocks.")


def ldm_unet_config(sd: dict[str, torch.Tensor], sample_size: int, heads: int | None
                    ) -> dict[str, Any]:
    """UNet2DConditionModel config from an LDM UNet state dict (prefix removed), without added
    conditioning. `sample_size` is the released latent size; `heads` the attention heads per
    level where the family fixes a count (SD 1.5: 8), else None for the 64-wide heads of SDXL
    (shapes do not record heads)."""
    width = sd["input_blocks.0.0.weight"].shape[0]
    n_levels = 1 + sum(1 for k in sd if k.startswith("input_blocks.") and k.endswith(".0.op.weight"))
    per_level = (count_blocks(sd, "input_blocks.") - 1 - (n_levels - 1)) // n_levels
    starts = _level_starts(n_levels, per_level)
    channels = [sd[f"input_blocks.{s}.0.out_layers.3.weight"].shape[0] for s in starts]
    depths = [_depth(sd, f"input_blocks.{s}") for s in starts]
    attn = next(f"input_blocks.{s}.1." for s, d in zip(starts, depths) if d)
    config: dict[str, Any] = {
        "sample_size": sample_size, "in_channels": sd["input_blocks.0.0.weight"].shape[1],
        "out_channels": sd["out.2.weight"].shape[0],
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depths],
        "up_block_types": ["CrossAttnUpBlock2D" if d else "UpBlock2D" for d in reversed(depths)],
        "mid_block_type": "UNetMidBlock2DCrossAttn" if _depth(sd, "middle_block") else None,
        "block_out_channels": channels, "layers_per_block": per_level,
        "transformer_layers_per_block": [max(d, 1) for d in depths],
        "attention_head_dim": ([heads] * len(channels) if heads
                               else [max(1, c // head_width(c)) for c in channels]),
        "norm_num_groups": norm_groups(width),
        "cross_attention_dim": sd[attn + "transformer_blocks.0.attn2.to_k.weight"].shape[1],
        "use_linear_projection": sd[attn + "proj_in.weight"].ndim == 2,
        "flip_sin_to_cos": True, "freq_shift": 0,
    }
    if sd["time_embed.0.weight"].shape[0] != 4 * width:
        config["time_embedding_dim"] = sd["time_embed.0.weight"].shape[0]
    config.update(_reverse_depths(sd, depths, per_level))
    return config


def _reverse_depths(sd: dict[str, torch.Tensor], depths: list[int], per_level: int) -> dict:
    """`reverse_transformer_layers_per_block` when the up path's depths differ from the down path's."""
    up = [_depth(sd, f"output_blocks.{level * (per_level + 1)}") for level in range(len(depths))]
    if up == list(reversed(depths)):
        return {}
    return {"reverse_transformer_layers_per_block": [[max(d, 1)] * (per_level + 1) for d in up]}


def check_ldm_layout(sd: dict[str, torch.Tensor], path: Path, model: str, example: str) -> None:
    """Refuse, before any work, a file without an LDM-layout UNet (an MMDiT, a diffusers-layout
    file, ...), naming the `model` expected and the released file (`example`) it should look like."""
    if not any(k.startswith(UNET_PREFIX + "input_blocks.") for k in sd):
        raise ModelFileError(f"{path} does not look like an {model} checkpoint: no "
                             f"{UNET_PREFIX}input_blocks.* tensors (expected the original "
                             f"layout of {example})")


def load_ldm_unet(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                  config: dict[str, Any], model: str) -> Any:
    """The `model` UNet (e.g. "SDXL") of a whole-checkpoint state dict with its derived
    `config`, converted by diffusers' LDM converter and assigned without a random init."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    try:
        unet_sd = convert_ldm_unet_checkpoint({k: v for k, v in sd.items()
                                               if k.startswith(UNET_PREFIX)}, config)
    except (KeyError, StopIteration, IndexError) as err:
        raise missing_error(path, f"an {model} UNet", err) from None
    with torch.device("meta"):
        model_ = UNet2DConditionModel(**config)
    return assign_state(model_, cast_state(unet_sd, dtype), path, f"{model} UNet")


def derive_config(sd: dict[str, torch.Tensor], path: Path, model: str, sample_size: int,
                  heads: int | None) -> dict[str, Any]:
    """`ldm_unet_config` of a whole checkpoint's UNet, a file lacking tensors it reads refused
    as missing parts of the `model` UNet."""
    try:
        return ldm_unet_config(prefixed(sd, UNET_PREFIX), sample_size, heads)
    except (KeyError, StopIteration, IndexError) as err:
        raise missing_error(path, f"an {model} UNet", err) from None


# --- the original (SGM) checkpoint layout, written for a full fine-tune ---------------------

_SGM_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
            "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0",
            "conv_out": "out.2"}
_SGM_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_SGM_MID = {"resnets.0": "middle_block.0", "attentions.0": "middle_block.1",
            "resnets.1": "middle_block.2"}


def sgm_unet_name(key: str, per_level: int, up_attention: list[bool]) -> str:
    """One diffusers UNet tensor name in the SGM numbering of the original checkpoints
    (`input_blocks.<i>.<j>`, `middle_block.<j>`, `output_blocks.<i>.<j>`): each level holds
    `per_level` layers (+1 going up) and then its down- or upsampler."""
    top = next((k for k in _SGM_TOP if key.startswith(k + ".")), None)
    if top is not None:
        return _SGM_TOP[top] + key[len(top):]
    part = key.split(".")
    if part[0] == "mid_block":
        head, rest = _SGM_MID[f"{part[1]}.{part[2]}"], part[3:]
    else:
        level, kind, j, rest = int(part[1]), part[2], int(part[3]), part[4:]
        down = part[0] == "down_blocks"
        sampler = kind in ("downsamplers", "upsamplers")
        index = (1 if down else 0) + level * (per_level + 1) + (per_level if sampler else j)
        slot = ("1" if kind == "attentions" else "0" if down or kind == "resnets"
                else "2" if up_attention[level] else "1")
        head = f"{'input_blocks' if down else 'output_blocks'}.{index}.{slot}"
        if sampler:
            rest = ["op" if down else "conv", rest[-1]]
    if "resnets" in part:
        rest = [_SGM_RESNET.get(".".join(rest[:-1]), ".".join(rest[:-1])), rest[-1]]
    return ".".join([head, *rest])


def ldm_single_file_layout(unet: torch.nn.Module, what: str) -> "Layout":
    """A UNet in the original checkpoint layout (`model.diffusion_model.input_blocks...`, as
    the released single files hold it; ComfyUI, Forge and diffusers' from_single_file read it),
    one tensor per tensor; `what` names the layout in errors."""
    from difftune.files.single import Piece, check_complete

    cfg, names = unet.config, list(unet.state_dict())
    up_attention = ["CrossAttn" in t for t in cfg.up_block_types]
    per_level = cfg.layers_per_block
    layout = {UNET_PREFIX + sgm_unet_name(n, per_level, up_attention): Piece((n,)) for n in names}
    return check_complete(layout, names, what)
