"""Wan's image-to-video start frame: what the transformer reads of a sample's first frame,
made by WanImageToVideoPipeline's own code so that training conditions exactly as sampling.

Both I2V kinds read `prepare_latents`' condition ("start": 4 channels of the first-frame mask
and 16 of the first frame followed by zero frames, VAE-encoded and normalized); Wan 2.1 I2V
also reads its CLIP vision encoder's features of the start image ("start_image": `encode_image`,
the penultimate hidden states of the image as its CLIPImageProcessor prepares it), which Wan
2.2 I2V A14B has no encoder for. The pipeline runs over the loaded VAE (and image encoder)
alone, one sample at a time, as it prepares its one start image.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from difftune.families.base import Components

# The pipeline components of the CLIP vision encoder (Wan 2.1 I2V), kept in `Components.extras`.
IMAGE_PARTS = ("image_encoder", "image_processor")


def preparer(c: Components) -> Any:
    """WanImageToVideoPipeline over the VAE and, where loaded, the image encoder: its
    `prepare_latents` and `encode_image` are what the condition is made with."""
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=c.vae, scheduler=None,
                                   **{p: c.extras.get(p) for p in IMAGE_PARTS})


def to_image(frame: torch.Tensor) -> Image.Image:
    """A (3, H, W) frame in [-1, 1] (8-bit values scaled, as training pixels are) -> the
    8-bit RGB image it was made from, as the pipeline takes a start image."""
    values = ((frame.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(values.permute(1, 2, 0).cpu().numpy())


@torch.no_grad()
def encode(c: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, 3, F, H, W) pixels in [-1, 1] -> {"start": (B, 20, f, h, w) float32, and for a
    model with an image encoder "start_image": (B, tokens, width)}, row by row."""
    prep = preparer(c)
    _, _, frames, height, width = pixels.shape
    device = next(c.vae.parameters()).device
    # noise is not drawn: a stand-in for the latents sets only their device and dtype
    stand_in = torch.zeros(1, device=device)
    rows: list[dict[str, torch.Tensor]] = []
    for row in pixels:
        first = row[None, :, 0].to(device, torch.float32)
        out = {"start": prep.prepare_latents(first, 1, c.vae.config.z_dim, height, width, frames,
                                             torch.float32, device, latents=stand_in)[1]}
        if c.extras.get("image_encoder") is not None:
            out["start_image"] = prep.encode_image(to_image(row[:, 0]), device)
        rows.append(out)
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
