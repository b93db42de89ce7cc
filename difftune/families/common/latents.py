"""Latent packing shared by the FLUX.1-style transformers (FLUX.1, Chroma).

These transformers read 16-channel VAE latents as a sequence of 2x2 patches (64 features a
token) with (0, row, col) position ids, exactly as FluxPipeline and ChromaPipeline pack them;
the functions live here once so every family built on that layout uses the same code.
"""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, C*4): 2x2 patches become tokens, as FluxPipeline packs."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack` for latents of height h and width w."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids (0, row, col) of the packed latent tokens."""
    rows = torch.arange(h // 2, device=device, dtype=dtype)[:, None].expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=device, dtype=dtype)[None, :].expand(h // 2, w // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)
    return ids.reshape(-1, 3)
