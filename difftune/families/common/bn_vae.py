"""FLUX.2's autoencoder (AutoencoderKLFlux2), shared by the families built on it (FLUX.2,
ERNIE-Image): its 2x2 patchify, the latent normalization by its batch-norm running statistics,
its tiny flavor, and its single file (`flux2-vae.safetensors`).

The pipelines patchify the autoencoder's (C, H/8, W/8) latents to (4C, H/16, W/16) and
normalize them per channel by `vae.bn`'s running mean and variance; difftune keeps latents in
the autoencoder's layout (per-element noise is the same distribution in either) and patchifies
where the transformer reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import norm_groups, vae_config
from difftune.families.common.single_file import (
    assign_state,
    cast_state,
    missing_error,
    read_safetensors,
    strip_prefix,
)

VAE_PREFIXES = ("first_stage_model.", "vae.")
TINY_LATENT_CHANNELS = 8  # patchified 2x2: 32 transformer input channels
TINY_VAE_CONFIG: dict[str, Any] = {
    "block_out_channels": (16, 16, 16, 16), "layers_per_block": 1, "norm_num_groups": 8,
    "latent_channels": TINY_LATENT_CHANNELS,
}


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
def normalized_latents(vae: Any, pixels: torch.Tensor, eps: float | None = None
                       ) -> torch.Tensor:
    """Pixels in [-1, 1] -> the distribution's mode, patchified, normalized by the batch-norm
    running statistics with `eps` (None: the autoencoder's configured `batch_norm_eps`), and
    unpatchified back to the autoencoder's (C, H/8, W/8) layout."""
    from difftune.families.common.text import module_device

    z = patchify(vae.encode(pixels.to(module_device(vae), vae.dtype)).latent_dist.mode())
    eps = vae.config.batch_norm_eps if eps is None else eps
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + eps)
    return unpatchify((z - mean) / std.to(z.device, z.dtype))


def tiny_vae() -> Any:
    """A tiny AutoencoderKLFlux2 (call it inside a seeded RNG) whose batch-norm statistics are
    moved away from (0, 1), so the latent normalization shows in tests."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**TINY_VAE_CONFIG)
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae.eval()


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """AutoencoderKLFlux2 from one file: the original layout (`encoder.down.*`, converted with
    diffusers' LDM autoencoder converter; `bn.*` kept as is) or the diffusers layout."""
    from diffusers import AutoencoderKLFlux2
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    sd = strip_prefix(read_safetensors(path, "FLUX.2 autoencoder"), VAE_PREFIXES)
    ldm = any(k.startswith("encoder.down.") for k in sd)
    if not ldm and not any(k.startswith("encoder.down_blocks.") for k in sd):
        raise ModelFileError(f"{path} does not look like a FLUX.2 autoencoder: no encoder.down.* "
                             "or encoder.down_blocks.* tensors")
    if "bn.running_mean" not in sd:
        raise ModelFileError(f"{path} has no bn.running_mean: it is not a FLUX.2 autoencoder "
                             "(FLUX.2 normalizes latents by its batch-norm statistics)")
    try:
        config = vae_config(sd, ldm=ldm)
        config.update(norm_num_groups=norm_groups(sd["encoder.conv_in.weight"].shape[0]))
        if ldm:
            bn = {k: v for k, v in sd.items() if k.startswith("bn.")}
            sd = {**convert_ldm_vae_checkpoint(sd, config), **bn}
    except KeyError as err:
        raise missing_error(path, "a FLUX.2 autoencoder", err) from None
    with torch.device("meta"):
        model = AutoencoderKLFlux2(**config)
    return assign_state(model, cast_state(sd, dtype), path, "FLUX.2 autoencoder")
