"""FLUX.3 components from single .safetensors files (helpers of `flux3/files.py`).

The transformer in BFL's original layout (`content_mode_blocks.image.N.q_proj`,
`txt_mode_blocks.N.*`, `single_blocks.N.*`, `early_stream_modulations.image.lin`, `time_in`,
`ref_time_in` for the distilled checkpoint, with or without `model.diffusion_model.`),
converted by diffusers' own convert_flux3_transformer_checkpoint_to_diffusers, or in the
diffusers layout; the autoencoder is FLUX.2's (`flux2-vae.safetensors`, read by FLUX.2's
loader) and the Qwen3-VL text encoder is read as Krea 2 reads its Qwen3-VL-4B. Sizes come from
the tensors' shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.families.common.bfl import transformer_from_file
from difftune.families.common.bn_vae import load_vae_file as load_vae_file  # noqa: F401
from difftune.families.common.single_file import count_blocks, missing_error
from difftune.families.flux2.single import ORIGINAL_PREFIXES
# FLUX.2's autoencoder and Krea 2's Qwen3-VL-4B readers, used as FLUX.3's (re-exported)
from difftune.families.krea2.single import (  # noqa: F401
    load_text_encoder_file as load_text_encoder_file,
)


def transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Flux3Transformer2DModel config from a diffusers-layout state dict's shapes (RoPE: the
    head size split evenly over the four (t, h, w, l) axes, (32, 32, 32, 32) at 128)."""
    try:
        hidden, in_channels = sd["x_embedders.image.weight"].shape
        head = sd["txt_mode_blocks.0.attn.norm_q.weight"].shape[0]
        return {"in_channels": in_channels,
                "cond_in_channels": sd["x_embedders.image_cond.weight"].shape[1],
                "num_layers": count_blocks(sd, "txt_mode_blocks."),
                "num_single_layers": count_blocks(sd, "single_transformer_blocks."),
                "attention_head_dim": head, "num_attention_heads": hidden // head,
                "joint_attention_dim": sd["context_embedder.weight"].shape[1],
                "timestep_channels": sd["timestep_embedder.linear_1.weight"].shape[1],
                "mlp_ratio": sd["txt_mode_blocks.0.ff.linear_out.weight"].shape[1] / hidden,
                "axes_dims_rope": (head // 4,) * 4,
                "flow_map": "target_timestep_embedder.linear_1.weight" in sd}
    except KeyError as err:
        raise missing_error(path, "a FLUX.3 transformer", err) from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """The transformer from one file, original layout (converted by diffusers) or diffusers'."""
    from diffusers import Flux3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_flux3_transformer_checkpoint_to_diffusers,
    )

    def build(sd: dict[str, torch.Tensor], where: Path) -> torch.nn.Module:
        return Flux3Transformer2DModel(**transformer_config(sd, where))

    return transformer_from_file(path, dtype, "FLUX.3 transformer", ORIGINAL_PREFIXES,
                                 lambda sd: convert_flux3_transformer_checkpoint_to_diffusers(
                                     dict(sd)), build,
                                 markers=("single_blocks.", "single_transformer_blocks."))
