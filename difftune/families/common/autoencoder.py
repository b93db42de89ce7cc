"""The 16-channel autoencoder of FLUX.1-style models (FLUX.1, Chroma) from one single file.

Users keep this autoencoder as BFL's `ae.safetensors` (LDM key layout) or as a diffusers-layout
file; both read into diffusers' AutoencoderKL here. The file carries no scaling/shift factors,
so the caller gives its model's (`scale`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import vae_config
from difftune.families.common.single_file import (assign_state, cast_state, read_safetensors,
                                                  strip_prefix)


def load_ae_file(path: Path, dtype: torch.dtype, scale: dict[str, float], what: str) -> Any:
    """An AutoencoderKL from `ae.safetensors` (BFL/LDM layout) or a diffusers-layout file.

    `scale` holds the model's `scaling_factor` and `shift_factor`; `what` names the model's
    autoencoder in errors ("FLUX.1 autoencoder").
    """
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    sd = read_safetensors(path, f"{what} (ae.safetensors)")
    ldm = "encoder.conv_in.weight" in sd and any(k.startswith("encoder.down.") for k in sd)
    if not ldm and "encoder.conv_in.weight" not in sd:
        sd = strip_prefix(sd, ("first_stage_model.", "vae."))
        ldm = any(k.startswith("encoder.down.") for k in sd)
    if "encoder.conv_in.weight" not in sd or "decoder.conv_out.weight" not in sd:
        raise ModelFileError(f"{path} does not look like an autoencoder: no encoder.conv_in / "
                             "decoder.conv_out tensors")
    config = {**vae_config(sd, ldm),
              "norm_num_groups": _norm_groups(sd["encoder.conv_in.weight"].shape[0]),
              **scale}
    if ldm:
        sd = convert_ldm_vae_checkpoint(sd, config)
    with torch.device("meta"):
        model = AutoencoderKL(**config)
    return assign_state(model, cast_state(sd, dtype), path, what)


def _norm_groups(first_width: int) -> int:
    """GroupNorm groups (not visible in shapes): FLUX.1's 32, or 4-channel groups when narrower.

    The FLUX.1 autoencoder starts at 128 channels with 32 groups; small test autoencoders
    (such as the tiny flavor's, 32 channels, 8 groups) keep 4 channels a group.
    """
    return 32 if first_width >= 128 else max(1, first_width // 4)
