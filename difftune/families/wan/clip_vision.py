"""Wan 2.1 I2V's CLIP vision encoder from ComfyUI's single file, `clip_vision_h.safetensors`.

ComfyUI reads that file (comfy/clip_vision.py `load`) in either of two namings, and so does
this: transformers' (`vision_model.embeddings.class_embedding`, `vision_model.encoder.
layers.N.self_attn.q_proj`, `visual_projection`), the file as ComfyUI distributes it, or
open_clip's (`visual.conv1`, `visual.transformer.resblocks.N.attn.in_proj_weight` holding q, k
and v stacked, `visual.proj`). Both become transformers' `CLIPVisionModel` names, the class the
folder's `image_encoder/` loads as (the pipeline reads its penultimate hidden states: the
projection, `visual_projection` / `visual.proj`, is not part of it and is left out). Sizes come
from the tensors' shapes; the head count, which no tensor records, is ViT-H/14's (80 wide) as
released, and the tiny flavor's (8 wide) below that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  read_safetensors)

WHAT = "CLIP vision encoder (clip_vision_h.safetensors)"
# Wan 2.1 I2V's CLIP vision encoder (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers image_encoder/, a
# CLIPVisionModelWithProjection of open-clip's ViT-H/14), written from its published config
# (and ComfyUI's clip_vision_config_h.json, the same values), not read from a file.
CONFIG: dict[str, Any] = {
    "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 16, "patch_size": 14, "image_size": 224, "projection_dim": 1024,
    "hidden_act": "gelu", "layer_norm_eps": 1e-5,
}
HEAD = 80  # ViT-H/14's head width (1280 / 16)
TINY_HEAD = 8  # the tiny flavor's
# open_clip's names outside the blocks -> CLIPVisionModel's
OPEN_CLIP_TOP = {"class_embedding": "embeddings.class_embedding",
                 "conv1.weight": "embeddings.patch_embedding.weight",
                 "positional_embedding": "embeddings.position_embedding.weight",
                 "ln_pre.weight": "pre_layrnorm.weight", "ln_pre.bias": "pre_layrnorm.bias",
                 "ln_post.weight": "post_layernorm.weight",
                 "ln_post.bias": "post_layernorm.bias"}
# ... and inside a block (after `transformer.resblocks.N.` / `encoder.layers.N.`)
OPEN_CLIP_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1",
                   "mlp.c_proj": "mlp.fc2", "attn.out_proj": "self_attn.out_proj"}
_RESBLOCKS = "transformer.resblocks."
# what the pipeline does not read: the projection (and a stored position-id buffer)
_LEFT_OUT = ("visual_projection.weight", "proj", "embeddings.position_ids")


def from_open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip's visual tower names (the `visual.` prefix removed) -> CLIPVisionModel's;
    each block's stacked `attn.in_proj_*` split into q, k and v."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        if name in OPEN_CLIP_TOP:
            out[OPEN_CLIP_TOP[name]] = tensor
            continue
        if not name.startswith(_RESBLOCKS):
            out[name] = tensor  # the projection (left out later), or a name the load reports
            continue
        number, _, rest = name[len(_RESBLOCKS):].partition(".")
        block = f"encoder.layers.{number}."
        part, _, kind = rest.rpartition(".")
        if part == "attn" and kind.startswith("in_proj_"):
            for which, piece in zip("qkv", tensor.chunk(3)):
                out[f"{block}self_attn.{which}_proj.{kind.removeprefix('in_proj_')}"] = piece
        else:
            out[f"{block}{OPEN_CLIP_BLOCK.get(part, part)}.{kind}"] = tensor
    return out


def config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """CLIPVisionConfig values from a CLIPVisionModel-named state dict's shapes."""
    try:
        width = sd["embeddings.class_embedding"].shape[0]
        patch = sd["embeddings.patch_embedding.weight"].shape[-1]
        positions = sd["embeddings.position_embedding.weight"].shape[0]
        inner = sd["encoder.layers.0.mlp.fc1.weight"].shape[0]
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a {WHAT}: tensor {err} is missing; "
                             "expected transformers' names (vision_model.encoder.layers.N...) "
                             "or open_clip's (visual.transformer.resblocks.N...)") from None
    side = round((positions - 1) ** 0.5)  # one position per patch, plus the class token
    return {**CONFIG, "hidden_size": width, "intermediate_size": inner,
            "num_hidden_layers": count_blocks(sd, "encoder.layers."),
            "num_attention_heads": width // (HEAD if width % HEAD == 0 else TINY_HEAD),
            "patch_size": patch, "image_size": side * patch}


def load_file(path: Path, dtype: torch.dtype) -> Any:
    """CLIPVisionModel from ComfyUI's `clip_vision_h.safetensors` (either naming)."""
    from accelerate import init_empty_weights
    from transformers import CLIPVisionConfig, CLIPVisionModel

    sd = read_safetensors(path, WHAT)
    if any(k.startswith("visual.") for k in sd):
        sd = from_open_clip({k.removeprefix("visual."): v for k, v in sd.items()})
    else:
        sd = {k.removeprefix("vision_model."): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if k not in _LEFT_OUT}
    # weights on the meta device (assigned from the file), its position-id buffer made
    with init_empty_weights(include_buffers=False):
        model = CLIPVisionModel(CLIPVisionConfig(**config(sd, path)))
    return assign_state(model, cast_state(sd, dtype), path, WHAT)
