"""The per-channel latent normalization of video-style VAEs (AutoencoderKLQwenImage and its
kin), written without family names so it can move to `families/common` when another family
uses the same VAE.

These VAEs encode (B, 3, frames, H, W) to (B, z, frames, h, w) and declare `latents_mean` and
`latents_std` (one per channel) in their config; a pipeline decodes `latents * std + mean`, so
training latents are `(z - mean) / std`. Images are one frame: the frame axis is added for the
VAE and dropped from the latents difftune trains on.
"""

from __future__ import annotations

import torch


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
def decode(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, z, h, w) -> pixels (B, 3, H, W), as the pipelines decode."""
    param = next(vae.parameters())
    z = latents.to(param.device, param.dtype)
    mean, std = channel_stats(vae, z)
    return vae.decode((z * std + mean).unsqueeze(2), return_dict=False)[0][:, :, 0]
