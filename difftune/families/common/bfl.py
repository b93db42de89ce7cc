"""What the models of the BFL (FLUX.1) architecture share: the flow-matching schedule with a
resolution-dependent shift, the RoPE split, the transformer config read from tensor shapes, and
loading such a transformer from one file in the original or the diffusers layout. FLUX.1 and
the models built on it (Chroma) read these rather than each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from difftune.errors import ModelFileError
from difftune.families.common.single_file import (
    assign_state,
    cast_state,
    count_blocks,
    read_safetensors,
    strip_prefix,
)

# FLUX.1-dev's sampling schedule (its scheduler_config.json), which models trained from it keep:
# the shift grows with the image's token count from base_shift at 256 to max_shift at 4096.
DYNAMIC_SHIFT_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# LoRA preset patterns (full match against the transformer's module names) every BFL-architecture
# transformer shares: attention projections of both block kinds, and the MLPs.
_BLOCK = r"(?:transformer_blocks|single_transformer_blocks)\.\d+\."
ATTENTION_PATTERNS = [
    _BLOCK + r"attn\.(?:to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)",
]
MLP_PATTERNS = [
    r"transformer_blocks\.\d+\.(?:ff|ff_context)\.net\.(?:0\.proj|2)",
    r"single_transformer_blocks\.\d+\.(?:proj_mlp|proj_out)",
]


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes for a head size: FLUX.1's (16, 56, 56) at 128, the same proportions elsewhere.

    The split carries no weights, so it cannot be read from a file; this rule reproduces FLUX.1
    exactly and gives even axes (as RoPE needs) for smaller variants (16 -> (4, 6, 6)).
    """
    side = (head_dim - head_dim // 8) // 2 // 2 * 2
    return (head_dim - 2 * side, side, side)


def transformer_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The config entries every BFL-architecture transformer has, from a diffusers-layout state
    dict's shapes (a missing tensor raises KeyError; the caller names the model)."""
    hidden, in_channels = sd["x_embedder.weight"].shape
    head_dim = sd["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    return {
        "patch_size": 1, "in_channels": in_channels,
        "out_channels": sd["proj_out.weight"].shape[0],
        "num_layers": count_blocks(sd, "transformer_blocks."),
        "num_single_layers": count_blocks(sd, "single_transformer_blocks."),
        "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": sd["context_embedder.weight"].shape[1],
        "axes_dims_rope": rope_axes(head_dim),
    }


def transformer_from_file(path: Path, dtype: torch.dtype, what: str,
                              prefixes: tuple[str, ...],
                              convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                              build: Callable[[dict[str, torch.Tensor], Path], torch.nn.Module]
                              ) -> Any:
    """A transformer of the BFL (double/single block) kind from one safetensors file.

    The file may be in the original layout (`double_blocks.*`, converted by `convert`) or in
    diffusers' (`transformer_blocks.*`); `prefixes` are stripped first (ComfyUI's
    `model.diffusion_model.` and the like). `build` makes the model from the diffusers-named
    tensors on the meta device; the tensors are then assigned in `dtype`.
    """
    sd = strip_prefix(read_safetensors(path, what), prefixes)
    if any(k.startswith("double_blocks.") for k in sd):
        try:
            sd = convert(sd)
        except (KeyError, RuntimeError, IndexError) as err:
            raise ModelFileError(f"{path} has original-layout {what} tensors but could not be "
                                 f"converted ({type(err).__name__}: {err}); the file may be "
                                 "incomplete or another model") from None
    elif not any(k.startswith("transformer_blocks.") for k in sd):
        raise ModelFileError(f"{path} does not look like a {what}: no double_blocks.* or "
                             "transformer_blocks.* tensors")
    with torch.device("meta"):
        model = build(sd, path)
    return assign_state(model, cast_state(sd, dtype), path, what)
