"""The video-style autoencoder several families share (diffusers' AutoencoderKLQwenImage and
AutoencoderKLWan, the Wan-2.1 design): its per-channel latent normalization and loading it
from a single file.

These VAEs encode (B, 3, frames, H, W) to (B, z, frames, h, w) and declare `latents_mean` and
`latents_std` (one per channel) in their config; a pipeline decodes `latents * std + mean`, so
training latents are `(z - mean) / std`. Images are one frame: the frame axis is added for the
VAE and dropped from the latents difftune trains on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  missing_error, read_safetensors, strip_prefix)

# The released autoencoder's config (diffusers' AutoencoderKLQwenImage; its latent statistics
# are the class defaults). Widths, depth and latent channels of a file are read from its shapes.
RELEASED_CONFIG: dict[str, Any] = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0,
}


def channel_stats(vae: torch.nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel (mean, std), shaped (1, C, 1, 1) like `like` (device, dtype)."""
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1)
    return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)


@torch.no_grad()
def encode(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 3, H, W) in [-1, 1] -> normalized latents (B, z, h, w): the distribution's
    mode (deterministic, so cacheable), normalized per channel."""
    param = next(vae.parameters())
    z = vae.encode(pixels.to(param.device, param.dtype).unsqueeze(2)).latent_dist.mode()
    z = z.squeeze(2)
    mean, std = channel_stats(vae, z)
    return (z - mean) / std


@torch.no_grad()
def encode_clip(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Clips (B, 3, F, H, W) in [-1, 1] -> normalized latents (B, z, f, h, w) (the mode,
    normalized per channel, as `encode` for one frame)."""
    param = next(vae.parameters())
    z = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    mean, std = channel_stats(vae, z[:, :, 0])
    return (z - mean.unsqueeze(2)) / std.unsqueeze(2)


@torch.no_grad()
def decode(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, z, h, w) -> pixels (B, 3, H, W), as the pipelines decode."""
    param = next(vae.parameters())
    z = latents.to(param.device, param.dtype)
    mean, std = channel_stats(vae, z)
    return vae.decode((z * std + mean).unsqueeze(2), return_dict=False)[0][:, :, 0]


def load_file(path: Path, dtype: torch.dtype, what: str, cls: Any = None) -> Any:
    """The autoencoder from one file (`qwen_image_vae.safetensors`, `wan_2.1_vae.safetensors`
    as ComfyUI keeps them): the original Wan-2.1 layout (`encoder.conv1`, converted by
    diffusers' Wan VAE converter) or the diffusers layout (`encoder.conv_in`), built as `cls`
    (AutoencoderKLQwenImage unless given: AutoencoderKLWan has the same modules). `what` names
    it in errors."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    sd = strip_prefix(read_safetensors(path, what), ("vae.",))
    if "encoder.conv_in.weight" not in sd:
        if "encoder.conv1.weight" not in sd:
            raise ModelFileError(f"{path} does not look like a {what}: neither encoder.conv1 "
                                 "(ComfyUI) nor encoder.conv_in (diffusers)")
        sd = convert_wan_vae_to_diffusers(dict(sd))
    try:
        config = {**RELEASED_CONFIG, "z_dim": sd["post_quant_conv.weight"].shape[0],
                  "base_dim": sd["encoder.conv_in.weight"].shape[0],
                  "num_res_blocks": count_blocks(sd, "decoder.up_blocks.0.resnets.") - 1}
    except KeyError as err:
        raise missing_error(path, f"a {what}", err) from None
    with torch.device("meta"):
        model = (cls or AutoencoderKLQwenImage)(**config)
    return assign_state(model, cast_state(sd, dtype), path, what)
