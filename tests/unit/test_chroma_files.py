"""Chroma's real model facts: Chroma1-HD's transformer config builds on the meta device with its
published size, and the config read back from a state dict's shapes is the same config."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ChromaTransformer2DModel

from difftune.families.chroma.files import TRANSFORMER_CONFIG, _transformer_config


def test_chroma1_hd_transformer_builds_on_meta_with_its_parameter_count() -> None:
    with torch.device("meta"):
        model = ChromaTransformer2DModel(**TRANSFORMER_CONFIG)
    assert sum(p.numel() for p in model.parameters()) == 8_899_983_424  # "8.9B"


def test_config_from_shapes_equals_the_released_config() -> None:
    with torch.device("meta"):
        model = ChromaTransformer2DModel(**TRANSFORMER_CONFIG)
    read = _transformer_config(model.state_dict(), Path("chroma.safetensors"))
    assert read == {**TRANSFORMER_CONFIG, "out_channels": 64}


def _original_layout(hidden: int = 3072, mlp: int = 12288, context: int = 4096,
                     channels: int = 64, approx: int = 5120, doubles: int = 19,
                     singles: int = 38, approx_layers: int = 5) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a Chroma checkpoint in its original (BFL-style) layout, as in
    `Chroma1-HD.safetensors`: FLUX.1's block names without per-block modulation, plus the
    distilled-guidance approximator."""
    shapes: dict[str, tuple[int, ...]] = {
        "img_in.weight": (hidden, channels), "img_in.bias": (hidden,),
        "txt_in.weight": (hidden, context), "txt_in.bias": (hidden,),
        "final_layer.linear.weight": (channels, hidden), "final_layer.linear.bias": (channels,),
        "distilled_guidance_layer.in_proj.weight": (approx, channels),
        "distilled_guidance_layer.in_proj.bias": (approx,),
        "distilled_guidance_layer.out_proj.weight": (hidden, approx),
        "distilled_guidance_layer.out_proj.bias": (hidden,),
    }
    head = 128
    for i in range(approx_layers):
        g = f"distilled_guidance_layer.layers.{i}."
        shapes |= {g + "in_layer.weight": (approx, approx), g + "in_layer.bias": (approx,),
                   g + "out_layer.weight": (approx, approx), g + "out_layer.bias": (approx,),
                   f"distilled_guidance_layer.norms.{i}.scale": (approx,)}
    for i in range(doubles):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}_"
            shapes |= {b + "attn.qkv.weight": (3 * hidden, hidden),
                       b + "attn.qkv.bias": (3 * hidden,),
                       b + "attn.proj.weight": (hidden, hidden), b + "attn.proj.bias": (hidden,),
                       b + "attn.norm.query_norm.scale": (head,),
                       b + "attn.norm.key_norm.scale": (head,),
                       b + "mlp.0.weight": (mlp, hidden), b + "mlp.0.bias": (mlp,),
                       b + "mlp.2.weight": (hidden, mlp), b + "mlp.2.bias": (hidden,)}
    for i in range(singles):
        b = f"single_blocks.{i}."
        shapes |= {b + "linear1.weight": (3 * hidden + mlp, hidden),
                   b + "linear1.bias": (3 * hidden + mlp,),
                   b + "linear2.weight": (hidden, hidden + mlp), b + "linear2.bias": (hidden,),
                   b + "norm.query_norm.scale": (head,), b + "norm.key_norm.scale": (head,)}
    return shapes


def test_full_width_original_layout_converts_to_the_released_model() -> None:
    """The original-layout checkpoint at Chroma1-HD's real width (on the meta device; diffusers'
    converter only handles the real width) goes through the conversion `load_transformer_file`
    uses, and what comes out fills the released model exactly: same keys, same shapes, and the
    config read from the shapes is the released one."""
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers)

    original = {f"model.diffusion_model.{k}": torch.empty(s, device="meta")
                for k, s in _original_layout().items()}
    converted = convert_chroma_transformer_checkpoint_to_diffusers(original)
    assert not original, f"keys the converter left unread: {sorted(original)[:5]}"
    with torch.device("meta"):
        model = ChromaTransformer2DModel(**TRANSFORMER_CONFIG)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in converted.items()} == expected
    read = _transformer_config(converted, Path("Chroma1-HD.safetensors"))
    assert read == {**TRANSFORMER_CONFIG, "out_channels": 64}
