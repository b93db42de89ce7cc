"""Latents of the Qwen-Image autoencoder (AutoencoderKLQwenImage), as Krea 2 uses them.

The autoencoder is a video one: it reads and writes (B, C, frames, H, W), and its latents are
normalized per channel with the `latents_mean` / `latents_std` of its config (not a scaling
and shift factor). Images are one frame. Nothing here names a family: the functions take the
autoencoder and could serve any family built on this autoencoder.
"""

from __future__ import annotations

import torch


def channel_stats(vae: torch.nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's per-channel latent mean and std, shaped (1, C, 1, 1, 1) like `like`."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


@torch.no_grad()
def encode_frames(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> normalized latents (B, C, H/8, W/8): one frame
    encoded, the posterior's mode (deterministic, so latents can be cached), then
    (z - mean) / std, the inverse of what the pipelines undo before decoding."""
    device = next(vae.parameters()).device
    z = vae.encode(pixels.to(device, vae.dtype).unsqueeze(2)).latent_dist.mode()
    mean, std = channel_stats(vae, z)
    return ((z - mean) / std).squeeze(2)


@torch.no_grad()
def decode_frames(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, C, h, w) -> pixels in [-1, 1] (B, 3, 8h, 8w), as the pipelines
    decode them (latents * std + mean, one frame)."""
    z = latents.unsqueeze(2).to(vae.dtype)
    mean, std = channel_stats(vae, z)
    return vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
