"""Tiny SDXL and SD3/3.5 flavors: real diffusers/transformers classes with tiny configs.

Like `tiny.build_tiny_flux`, these give tests and CPU end-to-end runs whole models that build
in about a second with no download. Each component is the class the real checkpoint uses
(UNet2DConditionModel or SD3Transformer2DModel, AutoencoderKL, CLIPTextModel(WithProjection),
T5EncoderModel, the offline tokenizers, the real schedulers), shaped like the real model
(SDXL's "text_time" conditioning and two-CLIP cross-attention width; SD3's CLIP-L + CLIP-G
pooled vector and T5 context) but with tiny widths, so every code path is the real one.

Sizes mirror the real relationships between components:
- SDXL: cross_attention_dim = CLIP-L hidden + CLIP-G hidden (768 + 1280 = 2048 in the real
  model), and the added-conditioning input = CLIP-G projection + 6 time ids x time-embed width.
- SD3: pooled_projection_dim = CLIP-L projection + CLIP-G projection, and T5's width is larger
  than the two CLIP widths together, because the pipeline zero-pads the concatenated CLIP
  hidden states up to T5's width before joining them to the T5 sequence (2048 -> 4096).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.tiny import (
    load_tiny_tokenizers,
    load_tiny_vae,
    new_tiny_vae,
    tiny_clip_config,
    tiny_t5_config,
)

SEED = 4321
SD3_T5_MAX_LENGTH = 32

# Text-encoder widths. "CLIP-L" and "CLIP-G" differ in width (and activation) as in the real
# models, so a mix-up of the two encoders shows up as a shape error, not a silent success.
CLIP_L_WIDTH = 32
CLIP_G_WIDTH = 64
SD3_T5_WIDTH = 128  # > CLIP_L_WIDTH + CLIP_G_WIDTH: exercises the pipeline's zero padding

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

# SDXL's autoencoder: 4 latent channels, 4 blocks (downscale 8), quant convs, SDXL's scale.
TINY_SDXL_VAE_OVERRIDES: dict[str, Any] = {
    "latent_channels": 4,
    "block_out_channels": [16, 16, 16, 16],
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "scaling_factor": 0.13025,
    "force_upcast": False,
}

# stabilityai/stable-diffusion-xl-base-1.0 scheduler_config.json (the training-relevant part).
SDXL_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
}

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

# SD3.5 scheduler_config.json.
SD3_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}


def _clip_encoder(tok: Any, width: int, projection: bool, act: str) -> Any:
    """A tiny CLIP text encoder of the given width; with a projection head if asked.

    Starts from `tiny_clip_config` so the token ids (and so CLIP's eos pooling) match the
    tokenizer; the projection width equals the hidden width, as for CLIP-G (and harmless for
    CLIP-L, whose real projection is also 768).
    """
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cfg = tiny_clip_config(len(tok), tok.bos_token_id, tok.eos_token_id)
    cfg.update({"hidden_size": width, "intermediate_size": 2 * width, "projection_dim": width,
                "num_attention_heads": max(2, width // 16), "hidden_act": act})
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(cfg).eval()


def _t5_encoder(tok: Any, width: int) -> Any:
    """A tiny T5 v1.1 encoder of the given width (ids taken from the tokenizer)."""
    from transformers import T5EncoderModel

    cfg = tiny_t5_config(len(tok), tok.pad_token_id, tok.eos_token_id)
    cfg.update({"d_model": width, "d_ff": width})
    return T5EncoderModel(cfg).eval()


def _sdxl_models(clip_tok: Any) -> dict[str, Any]:
    """UNet, VAE and both CLIPs of tiny SDXL, random-init from SEED inside a forked RNG."""
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        unet = UNet2DConditionModel(**TINY_SDXL_UNET_CONFIG)
        vae = new_tiny_vae(TINY_SDXL_VAE_OVERRIDES)
        te1 = _clip_encoder(clip_tok, CLIP_L_WIDTH, projection=False, act="quick_gelu")
        te2 = _clip_encoder(clip_tok, CLIP_G_WIDTH, projection=True, act="gelu")
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


def _sd3_models(clip_tok: Any, t5_tok: Any) -> dict[str, Any]:
    """Transformer and the three text encoders of tiny SD3, from SEED inside a forked RNG."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER_CONFIG)
        te1 = _clip_encoder(clip_tok, CLIP_L_WIDTH, projection=True, act="quick_gelu")
        te2 = _clip_encoder(clip_tok, CLIP_G_WIDTH, projection=True, act="gelu")
        te3 = _t5_encoder(t5_tok, SD3_T5_WIDTH)
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
    parts = _sd3_models(clip_tok, t5_tok)
    with torch.random.fork_rng(devices=[]):  # its (overwritten) init would draw from the RNG
        vae = load_tiny_vae()
    return {
        **parts,
        "vae": vae,
        "tokenizer": clip_tok,
        "tokenizer_2": clip_tok_2,
        "tokenizer_3": t5_tok,
        "scheduler": FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
        "t5_max_length": SD3_T5_MAX_LENGTH,
    }
