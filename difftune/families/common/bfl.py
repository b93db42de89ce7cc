"""What the models of the BFL (FLUX.1) architecture share: the flow-matching schedule with a
resolution-dependent shift, the RoPE split, the transformer config read from tensor shapes, and
loading such a transformer from one file in the original or the diffusers layout. FLUX.1 and
the models built on it (Chroma) read these rather than each other."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from difftune.errors import ModelFileError
from difftune.families.common.single_file import (
    assign_state,
    cast_state,
    count_blocks,
    read_safetensors,
    strip_prefix,
)

if TYPE_CHECKING:
    from difftune.files.single import Piece

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
                              build: Callable[[dict[str, torch.Tensor], Path], torch.nn.Module],
                              markers: tuple[str, str] = ("double_blocks.", "transformer_blocks.")
                              ) -> Any:
    """A transformer of the BFL (double/single block) kind from one safetensors file.

    The file may be in the original layout (tensors under `markers[0]`, `double_blocks.*` by
    default, converted by `convert`) or in diffusers' (under `markers[1]`,
    `transformer_blocks.*`); `prefixes` are stripped first (ComfyUI's
    `model.diffusion_model.` and the like). `build` makes the model from the diffusers-named
    tensors on the meta device; the tensors are then assigned in `dtype`.
    """
    original, diffusers = markers
    sd = strip_prefix(read_safetensors(path, what), prefixes)
    if any(k.startswith(original) for k in sd):
        try:
            sd = convert(sd)
        except (KeyError, RuntimeError, IndexError) as err:
            raise ModelFileError(f"{path} has original-layout {what} tensors but could not be "
                                 f"converted ({type(err).__name__}: {err}); the file may be "
                                 "incomplete or another model") from None
    elif not any(k.startswith(diffusers) for k in sd):
        raise ModelFileError(f"{path} does not look like a {what}: no {original}* or "
                             f"{diffusers}* tensors")
    with torch.device("meta"):
        model = build(sd, path)
    return assign_state(model, cast_state(sd, dtype), path, what)


# --- BFL's own names of the double and single blocks (single files of FLUX.1 and Chroma) ----

_DOUBLE = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
           "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
           "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
           "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
           "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.norm_added_q": "txt_attn.norm.query_norm",
           "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2",
           "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
# Fused tensors: BFL name -> the diffusers module names stacked in it.
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}


def bfl_blocks_layout(names: list[str]) -> "dict[str, Piece]":
    """The double and single blocks of a FLUX.1-kind transformer (diffusers state-dict
    `names`) in BFL's names: fused qkv (the single blocks' q, k, v and MLP input in `linear1`),
    RMSNorm weights as `.scale`; modules a model lacks (Chroma's per-block modulation) are
    left out."""
    from difftune.files.single import Piece

    out: dict[str, Piece] = {}
    have = set(names)
    for prefix, bfl, renamed, fused in (
            ("transformer_blocks.", "double_blocks.", _DOUBLE, _DOUBLE_FUSED),
            ("single_transformer_blocks.", "single_blocks.", _SINGLE, _SINGLE_FUSED)):
        for i in range(count_blocks(dict.fromkeys(names), prefix)):
            p, b = f"{prefix}{i}.", f"{bfl}{i}."
            for src, dst in renamed.items():
                for kind in ("weight", "bias"):
                    if f"{p}{src}.{kind}" in have:
                        name = "scale" if dst.endswith("_norm") else kind  # RMSNorm weights
                        out[f"{b}{dst}.{name}"] = Piece((f"{p}{src}.{kind}",))
            for dst, parts in fused.items():
                for kind in ("weight", "bias"):
                    if f"{p}{parts[0]}.{kind}" in have:
                        out[f"{b}{dst}.{kind}"] = Piece(tuple(f"{p}{x}.{kind}" for x in parts))
    return out
