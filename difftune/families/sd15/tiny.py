"""The tiny SD 1.5 flavor: real diffusers/transformers classes with tiny configs.

Like the other tiny flavors, it gives tests and CPU end-to-end runs a whole model that builds
in about a second with no download. Each component is the class the released model uses
(UNet2DConditionModel, AutoencoderKL, CLIPTextModel, the project's offline CLIP tokenizer with
CLIP's special tokens, the released PNDM scheduler config), shaped like SD 1.5: cross-attention
on every level but the lowest, conv (not linear) proj_in/proj_out, a fixed head count per
level, no added conditioning, one CLIP whose width is the UNet's context width.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.tiny import (CLIP_L_WIDTH, TINY_LDM_VAE, clip_encoder,
                                           load_tiny_tokenizers, new_tiny_vae)
from difftune.families.sd15.files import SD15_SCHEDULER_CONFIG

SEED = 1515

TINY_SD15_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,  # latents of 64x64 pixel images
    "in_channels": 4,
    "out_channels": 4,
    # SD 1.5: CrossAttn on the upper levels, a plain DownBlock2D/UpBlock2D at the lowest.
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "block_out_channels": (32, 32, 64),
    "layers_per_block": 2,  # as SD 1.5, so kohya/LDM block numbering keeps its shape
    # diffusers' misnomer: the number of heads per level, 8 as in SD 1.5 (which shapes do not
    # record: the single-file reader assumes it).
    "attention_head_dim": 8,
    "norm_num_groups": 8,
    "cross_attention_dim": CLIP_L_WIDTH,
    "use_linear_projection": False,  # SD 1.5's proj_in/proj_out are 1x1 convolutions
    "flip_sin_to_cos": True,
    "freq_shift": 0,
}

# SD 1.5's autoencoder: the Stable Diffusion shape with SD 1.5's scale.
TINY_SD15_VAE_OVERRIDES: dict[str, Any] = {**TINY_LDM_VAE, "scaling_factor": 0.18215}


def build_tiny_sd15() -> dict[str, Any]:
    """All components of a tiny SD-1.5-like model, keyed as StableDiffusionPipeline names them.

    Deterministic: the same weights on every call, and the caller's global RNG state is left
    as it was. The VAE is random-initialised (SD 1.5 flows and shapes only; it does not
    reconstruct images). The tokenizer is the shipped offline CLIP tokenizer (77 tokens).
    """
    from diffusers import PNDMScheduler, UNet2DConditionModel

    tokenizer, _ = load_tiny_tokenizers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        unet = UNet2DConditionModel(**TINY_SD15_UNET_CONFIG).eval()
        vae = new_tiny_vae(TINY_SD15_VAE_OVERRIDES).eval()
        text_encoder = clip_encoder(tokenizer, CLIP_L_WIDTH, projection=False, act="quick_gelu")
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": PNDMScheduler(**SD15_SCHEDULER_CONFIG)}
