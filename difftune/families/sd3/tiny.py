"""The tiny SD3/3.5 flavor: real diffusers/transformers classes with tiny configs.

Like the tiny FLUX.1 flavor, it gives tests and CPU end-to-end runs a whole model that builds in
about a second with no download. Each component is the class the real checkpoint uses
(SD3Transformer2DModel, AutoencoderKL, CLIPTextModelWithProjection, T5EncoderModel, the offline
tokenizers, the real scheduler), shaped like the real model (CLIP-L + CLIP-G pooled vector and
T5 context) but with tiny widths, so every code path is the real one.

Sizes mirror the real relationships between components: pooled_projection_dim = CLIP-L
projection + CLIP-G projection, and T5's width is larger than the two CLIP widths together,
because the pipeline zero-pads the concatenated CLIP hidden states up to T5's width before
joining them to the T5 sequence (2048 -> 4096).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import (CLIP_G_WIDTH, CLIP_L_WIDTH, clip_encoder,
                                           load_tiny_tokenizers, load_tiny_vae, t5_encoder)
from difftune.families.sd3.files import SD3_SCHEDULER_CONFIG

SEED = 4321
SD3_T5_MAX_LENGTH = 32
SD3_T5_WIDTH = 128  # > CLIP_L_WIDTH + CLIP_G_WIDTH: exercises the pipeline's zero padding

TINY_SD3_TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": SD3_T5_WIDTH,
    "caption_projection_dim": 64,  # = heads x head dim, as in SD3/3.5
    "pooled_projection_dim": CLIP_L_WIDTH + CLIP_G_WIDTH,
    "pos_embed_max_size": 16,  # up to 16x16 patches: 256x256 pixels
    "qk_norm": "rms_norm",  # SD3.5's query/key normalisation
}


def _sd3_models(clip_tok: Any, t5_tok: Any) -> dict[str, Any]:
    """Transformer and the three text encoders of tiny SD3, from SEED inside a forked RNG."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER_CONFIG)
        te1 = clip_encoder(clip_tok, CLIP_L_WIDTH, projection=True, act="quick_gelu")
        te2 = clip_encoder(clip_tok, CLIP_G_WIDTH, projection=True, act="gelu")
        te3 = t5_encoder(t5_tok, SD3_T5_WIDTH)
    return {"transformer": transformer.eval(), "text_encoder": te1, "text_encoder_2": te2,
            "text_encoder_3": te3}


def build_tiny_sd3() -> dict[str, Any]:
    """All components of a tiny SD3.5-like model, keyed as StableDiffusion3Pipeline names them.

    Deterministic like `build_tiny_sdxl`. The autoencoder is the shipped pretrained tiny one
    (16 latent channels, downscale 8, no quant convs, measured scale and shift: the same layout
    as SD3's). Also returns "t5_max_length", the tiny T5 sequence length, which is not a
    pipeline component: drop it before calling StableDiffusion3Pipeline(**parts).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    clip_tok, t5_tok = load_tiny_tokenizers()
    clip_tok_2, _ = load_tiny_tokenizers()
    return {
        **_sd3_models(clip_tok, t5_tok),
        "vae": load_tiny_vae(),
        "tokenizer": clip_tok,
        "tokenizer_2": clip_tok_2,
        "tokenizer_3": t5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
        "t5_max_length": SD3_T5_MAX_LENGTH,
    }
