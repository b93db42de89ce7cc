"""Krea 2 components from single .safetensors files, as ComfyUI users keep them.

The transformer in the original layout (`blocks.N.attn.wq`, `txtfusion.*`, with or without
`model.diffusion_model.`), converted by diffusers' own
convert_krea2_transformer_checkpoint_to_diffusers, or already in the diffusers layout; the
Qwen-Image autoencoder in the original (Wan 2.1) layout, converted by diffusers'
convert_wan_vae_to_diffusers (the same module tree), or in the diffusers layout; the Qwen3-VL
text encoder as a Qwen3VLForConditionalGeneration (`model.language_model.*`), a bare
Qwen3VLModel (`language_model.*`) or as ComfyUI keeps it (comfy/text_encoders/qwen3vl.py:
the language model under `model.`, the vision tower under `visual.`). Sizes come from the
tensors' shapes, the rest from the released configs (files.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.families.common import frame_vae
from difftune.families.common.components import pretrained_from_state
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  missing_error, read_safetensors, strip_prefix)
from difftune.families.krea2.released import TEXT_CONFIG, TRANSFORMER_CONFIG

_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# The vision tower, which text prompts never run: a stub of no blocks (a file's vision weights
# are not read), so only the language model's weights are held.
STUB_VISION: dict[str, Any] = {"depth": 0, "hidden_size": 16, "intermediate_size": 16,
                               "num_heads": 1, "deepstack_visual_indexes": []}


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary axes for a head size: Krea 2's (32, 48, 48) at 128, the same proportions
    elsewhere ((4, 6, 6) at 16)."""
    side = head_dim * 3 // 8
    return (head_dim - 2 * side, side, side)


def mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's mRoPE split of the rotary half for a head size: [24, 20, 20] at 128, the same
    rule elsewhere ([4, 2, 2] at 16)."""
    half = head_dim // 2
    side = half * 5 // 16
    return [half - 2 * side, side, side]


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Krea2Transformer2DModel config from a diffusers-layout state dict's shapes."""
    try:
        hidden, patch_in = sd["img_in.weight"].shape
        head = sd["transformer_blocks.0.attn.norm_q.weight"].shape[0]
        text = "text_fusion.layerwise_blocks.0."
        text_dim = sd["txt_in.linear_1.weight"].shape[1]
        text_head = sd[text + "attn.norm_q.weight"].shape[0]
        return {**TRANSFORMER_CONFIG, "in_channels": patch_in,
                "num_layers": count_blocks(sd, "transformer_blocks."),
                "attention_head_dim": head, "num_attention_heads": hidden // head,
                "num_key_value_heads": sd["transformer_blocks.0.attn.to_k.weight"].shape[0] // head,
                "intermediate_size": sd["transformer_blocks.0.ff.gate.weight"].shape[0],
                "timestep_embed_dim": sd["time_embed.linear_1.weight"].shape[1],
                "text_hidden_dim": text_dim,
                "num_text_layers": sd["text_fusion.projector.weight"].shape[1],
                "text_num_attention_heads": text_dim // text_head,
                "text_num_key_value_heads": sd[text + "attn.to_k.weight"].shape[0] // text_head,
                "text_intermediate_size": sd[text + "ff.gate.weight"].shape[0],
                "num_layerwise_text_blocks": count_blocks(sd, "text_fusion.layerwise_blocks."),
                "num_refiner_text_blocks": count_blocks(sd, "text_fusion.refiner_blocks."),
                "axes_dims_rope": rope_axes(head)}
    except KeyError as err:
        raise missing_error(path, "a Krea 2 transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file: original layout (converted by diffusers' converter) or
    diffusers layout."""
    from diffusers import Krea2Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_krea2_transformer_checkpoint_to_diffusers)

    sd = strip_prefix(read_safetensors(path, "Krea 2 transformer"), _ORIGINAL_PREFIXES)
    if "img_in.weight" not in sd:
        sd = convert_krea2_transformer_checkpoint_to_diffusers(dict(sd))
    with torch.device("meta"):
        model = Krea2Transformer2DModel(**transformer_config(sd, path))
    return assign_state(model, cast_state(sd, dtype), path, "Krea 2 transformer")


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """The Qwen-Image autoencoder from one file (`qwen_image_vae.safetensors`: Wan-2.1 layout
    as ComfyUI keeps it, or diffusers')."""
    return frame_vae.load_file(path, dtype, "Qwen-Image autoencoder")

def text_encoder_config(sd: dict[str, torch.Tensor], path: Path) -> Any:
    """Qwen3VLConfig from a language model's shapes (`language_model.*`), stub vision tower."""
    from transformers import Qwen3VLConfig

    lm = "language_model."
    try:
        vocab, hidden = sd[lm + "embed_tokens.weight"].shape
        head = sd[lm + "layers.0.self_attn.q_norm.weight"].shape[0]
        text = {**TEXT_CONFIG, "vocab_size": vocab, "hidden_size": hidden, "head_dim": head,
                "num_hidden_layers": count_blocks(sd, lm + "layers."),
                "num_attention_heads": sd[lm + "layers.0.self_attn.q_proj.weight"].shape[0] // head,
                "num_key_value_heads": sd[lm + "layers.0.self_attn.k_proj.weight"].shape[0] // head,
                "intermediate_size": sd[lm + "layers.0.mlp.gate_proj.weight"].shape[0],
                "rope_parameters": {**TEXT_CONFIG["rope_parameters"],
                                    "mrope_section": mrope_section(head)}}
    except KeyError as err:
        raise missing_error(path, "a Qwen3-VL text encoder", err) from None
    return Qwen3VLConfig(text_config=text, vision_config={**STUB_VISION, "out_hidden_size": hidden})


def load_text_encoder_file(path: Path, dtype: torch.dtype) -> Any:
    """Qwen3VLModel from one file: its language model's weights (any LM head and vision
    weights left out) under the stub vision tower, zero-filled."""
    from transformers import Qwen3VLModel

    sd = strip_prefix(read_safetensors(path, "Qwen3-VL text encoder"), ("model.",))
    if not any(k.startswith("language_model.") for k in sd):
        sd = {f"language_model.{k}": v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if k.startswith("language_model.")}
    config = text_encoder_config(sd, path)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3VLModel(config).state_dict().items()
                  if k.startswith("visual.")}
    sd = cast_state(sd, dtype) | {k: torch.zeros(s, dtype=dtype) for k, s in shapes.items()}
    return pretrained_from_state(Qwen3VLModel, config, sd, dtype, path, "Qwen3-VL",
                                 "model.text_encoder")
