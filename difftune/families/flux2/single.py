"""FLUX.2 components from the single files ComfyUI users keep (helpers of `flux2/files.py`).

The transformer (`flux-2-klein-4b.safetensors`, `flux2_dev_*.safetensors`) in BFL's original
layout, converted with diffusers' own `convert_flux2_transformer_checkpoint_to_diffusers`, or in
the diffusers layout; the autoencoder (`flux2-vae.safetensors`) in the original (LDM-style, with
its batch-norm statistics) or the diffusers layout; klein's Qwen3 text encoder
(`qwen_3_4b.safetensors`, `qwen_3_8b.safetensors`: the causal LM's tensors). Sizes come from
tensor shapes; what shapes do not record (RoPE split, norm groups) follows the released models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.bfl import transformer_from_file
from difftune.families.common.bn_vae import load_vae_file  # noqa: F401 (files.py reads it here)
from difftune.families.common.components import pretrained_from_state
from difftune.families.common.single_file import (
    cast_state,
    count_blocks,
    missing_error,
    read_safetensors,
)

ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# Qwen3-4B's settings that single files do not record (Qwen3-8B shares them).
QWEN3_CONFIG: dict[str, Any] = {"max_position_embeddings": 40960, "rope_theta": 1000000.0,
                                "rms_norm_eps": 1e-6}


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Flux2Transformer2DModel config from a diffusers-layout state dict's shapes (RoPE: the
    head size split evenly over FLUX.2's four axes, (32, 32, 32, 32) at 128)."""
    try:
        hidden, in_channels = sd["x_embedder.weight"].shape
        head = sd["transformer_blocks.0.attn.norm_q.weight"].shape[0]
        return {"in_channels": in_channels, "out_channels": sd["proj_out.weight"].shape[0],
                "num_layers": count_blocks(sd, "transformer_blocks."),
                "num_single_layers": count_blocks(sd, "single_transformer_blocks."),
                "attention_head_dim": head, "num_attention_heads": hidden // head,
                "joint_attention_dim": sd["context_embedder.weight"].shape[1],
                "timestep_guidance_channels":
                    sd["time_guidance_embed.timestep_embedder.linear_1.weight"].shape[1],
                "mlp_ratio": sd["transformer_blocks.0.ff.linear_out.weight"].shape[1] / hidden,
                "axes_dims_rope": (head // 4,) * 4,
                "guidance_embeds": "time_guidance_embed.guidance_embedder.linear_1.weight" in sd}
    except KeyError as err:
        raise missing_error(path, "a FLUX.2 transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file, original layout (converted by diffusers) or diffusers'."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_flux2_transformer_checkpoint_to_diffusers,
    )

    def build(sd: dict[str, torch.Tensor], where: Path) -> torch.nn.Module:
        return Flux2Transformer2DModel(**transformer_config(sd, where))

    return transformer_from_file(path, dtype, "FLUX.2 transformer", ORIGINAL_PREFIXES,
                                 lambda sd: convert_flux2_transformer_checkpoint_to_diffusers(
                                     dict(sd)), build)


def load_text_encoder_file(path: Path, dtype: torch.dtype, variant: str) -> Any:
    """klein's Qwen3ForCausalLM from one file (`model.*` tensors; a missing `lm_head` is the
    tied embedding); dev's Mistral 3 is read from model.path's text_encoder/ only."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if variant != "klein":
        raise ModelFileError(f"model.text_encoder = {path}: FLUX.2 {variant}'s Mistral 3 text "
                             "encoder is read from model.path's text_encoder/ folder; remove "
                             "model.text_encoder")
    sd = read_safetensors(path, "Qwen3 text encoder")
    if not any(k.startswith("model.") for k in sd):
        sd = {f"model.{k}": v for k, v in sd.items()}
    try:
        vocab, hidden = sd["model.embed_tokens.weight"].shape
        head = sd["model.layers.0.self_attn.q_norm.weight"].shape[0]
        tied = "lm_head.weight" not in sd
        config = Qwen3Config(**QWEN3_CONFIG, vocab_size=vocab, hidden_size=hidden, head_dim=head,
                             num_hidden_layers=count_blocks(sd, "model.layers."),
                             num_attention_heads=sd["model.layers.0.self_attn.q_proj.weight"]
                             .shape[0] // head,
                             num_key_value_heads=sd["model.layers.0.self_attn.k_proj.weight"]
                             .shape[0] // head,
                             intermediate_size=sd["model.layers.0.mlp.gate_proj.weight"].shape[0],
                             tie_word_embeddings=tied)
    except KeyError as err:
        raise missing_error(path, "a Qwen3 text encoder", err) from None
    if tied:
        sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
    return pretrained_from_state(Qwen3ForCausalLM, config, cast_state(sd, dtype), dtype, path,
                                 "Qwen3", "model.text_encoder")
