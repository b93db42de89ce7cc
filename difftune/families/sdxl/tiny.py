"""The tiny SDXL flavor: real diffusers/transformers classes with tiny configs.

Like the tiny FLUX.1 flavor, it gives tests and CPU end-to-end runs a whole model that builds in
about a second with no download. Each component is the class the real checkpoint uses
(UNet2DConditionModel, AutoencoderKL, CLIPTextModel(WithProjection), the offline tokenizer, the
real scheduler), shaped like the real model (its "text_time" conditioning and two-CLIP
cross-attention width) but with tiny widths, so every code path is the real one.

Sizes mirror the real relationships between components: cross_attention_dim = CLIP-L hidden +
CLIP-G hidden (768 + 1280 = 2048 in the real model), and the added-conditioning input = CLIP-G
projection + 6 time ids x time-embed width.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import (CLIP_G_WIDTH, CLIP_L_WIDTH, TINY_LDM_VAE,
                                           clip_encoder, load_tiny_tokenizers, new_tiny_vae)
from difftune.families.sdxl.files import SDXL_SCHEDULER_CONFIG

SEED = 4321

SDXL_TIME_EMBED_DIM = 8  # width of each of the 6 embedded time ids (256 in SDXL)

TINY_SDXL_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,  # latents of 64x64 pixel images
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "block_out_channels": (32, 64),
    "layers_per_block": 2,  # as SDXL, so kohya/SGM block numbering keeps its shape
    "transformer_layers_per_block": (1, 2),  # depth grows with level, as SDXL's (1, 2, 10)
    # diffusers' misnomer: for UNet2DConditionModel this is the number of heads per level.
    "attention_head_dim": (2, 4),
    "norm_num_groups": 8,
    "cross_attention_dim": CLIP_L_WIDTH + CLIP_G_WIDTH,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": SDXL_TIME_EMBED_DIM,
    # CLIP-G's pooled projection, then 6 time ids (original size, crop top-left, target size).
    "projection_class_embeddings_input_dim": CLIP_G_WIDTH + 6 * SDXL_TIME_EMBED_DIM,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
}

# SDXL's autoencoder: the Stable Diffusion shape with SDXL's scale.
TINY_SDXL_VAE_OVERRIDES: dict[str, Any] = {**TINY_LDM_VAE, "scaling_factor": 0.13025,
                                           "force_upcast": False}


def _sdxl_models(clip_tok: Any) -> dict[str, Any]:
    """UNet, VAE and both CLIPs of tiny SDXL, random-init from SEED inside a forked RNG."""
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        unet = UNet2DConditionModel(**TINY_SDXL_UNET_CONFIG)
        vae = new_tiny_vae(TINY_SDXL_VAE_OVERRIDES)
        te1 = clip_encoder(clip_tok, CLIP_L_WIDTH, projection=False, act="quick_gelu")
        te2 = clip_encoder(clip_tok, CLIP_G_WIDTH, projection=True, act="gelu")
    return {"unet": unet.eval(), "vae": vae.eval(), "text_encoder": te1, "text_encoder_2": te2}


def build_tiny_sdxl() -> dict[str, Any]:
    """All components of a tiny SDXL-base-like model, keyed as StableDiffusionXLPipeline names them.

    Deterministic: the same weights on every call, and the caller's global RNG state is left as
    it was. The VAE is random-initialised (SDXL flows and shapes only; it does not reconstruct
    images). Both tokenizers are the shipped offline CLIP tokenizer (77 tokens, pad = eos).
    """
    from diffusers import EulerDiscreteScheduler

    clip_tok, _ = load_tiny_tokenizers()
    clip_tok_2, _ = load_tiny_tokenizers()  # separate objects: a caller may edit one of them
    return {
        **_sdxl_models(clip_tok),
        "tokenizer": clip_tok,
        "tokenizer_2": clip_tok_2,
        "scheduler": EulerDiscreteScheduler(**SDXL_SCHEDULER_CONFIG),
    }

