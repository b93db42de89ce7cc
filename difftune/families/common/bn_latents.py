"""Latents of FLUX.2's autoencoder (AutoencoderKLFlux2), shared by the families built on it
(FLUX.2, FLUX.3).

Their pipelines encode an image to the distribution's mode, patchify it 2x2 (each patch's
values as channels: 4x the channels at half the sides) and normalize it by the autoencoder's
batch-norm running statistics; difftune keeps the result in the autoencoder's (C, H/8, W/8)
layout (`unpatchify` of it), where per-element noise is the same distribution, and each
family patchifies again for its transformer.
"""

from __future__ import annotations

import torch


def patchify(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2): each 2x2 patch's values as channels (c, dy, dx)."""
    b, c, h, w = z.shape
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`: (B, 4C, h, w) -> (B, C, 2h, 2w)."""
    b, c, h, w = z.shape
    z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return z.reshape(b, c // 4, h * 2, w * 2)


@torch.no_grad()
def encode(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] -> the distribution's mode, patchified, normalized by the VAE's
    batch-norm running statistics (as the pipelines encode), returned unpatchified."""
    from difftune.families.common.text import module_device

    z = patchify(vae.encode(pixels.to(module_device(vae), vae.dtype)).latent_dist.mode())
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return unpatchify((z - mean) / std.to(z.device, z.dtype))
