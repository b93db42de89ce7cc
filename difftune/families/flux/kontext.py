"""FLUX.1 Kontext's conditioning: how its input image is sized, packed and placed.

FluxKontextPipeline (diffusers) resizes its input image to the entry of its list of preferred
resolutions closest in aspect ratio (`_auto_resize`), floors the sides to multiples of 16 (the
VAE's 8x downscale times the 2x2 packing), encodes it with the VAE's mode, packs it like the
target latents and appends its tokens after the target's, with image ids whose first
coordinate is 1 (the target's is 0). The transformer's output is cut back to the target's
tokens. These facts were read from diffusers' pipeline; the code is written here.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.common.latents import image_ids, pack

# The resolutions (width, height) FLUX.1 Kontext was trained at, as FluxKontextPipeline lists
# them (PREFERRED_KONTEXT_RESOLUTIONS): about one megapixel each.
PREFERRED: tuple[tuple[int, int], ...] = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
    (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
    (1456, 720), (1504, 688), (1568, 672),
)
PREFERRED_SIDE = 1024  # the side whose square has the preferred resolutions' area
MULTIPLE = 16  # VAE downscale 8 x 2x2 packing
RULE = f"kontext-preferred-aspect/{PREFERRED_SIDE}/{MULTIPLE}"


def control_size(image_size: tuple[int, int], resolution: int) -> tuple[int, int]:
    """(width, height) of a Kontext input image of upright `image_size` at `resolution`.

    The preferred resolution closest in aspect ratio (ties: the first, as `min` over the list
    picks in the pipeline), scaled by `resolution / 1024` per side (so its area is about
    resolution squared), each side floored to a multiple of 16 (at least 16). At resolution
    1024 this is exactly FluxKontextPipeline's `_auto_resize` rule.
    """
    w, h = image_size
    aspect = w / h
    _, pw, ph = min((abs(aspect - a / b), a, b) for a, b in PREFERRED)
    if resolution != PREFERRED_SIDE:
        pw, ph = round(pw * resolution / PREFERRED_SIDE), round(ph * resolution / PREFERRED_SIDE)
    return (max(MULTIPLE, pw // MULTIPLE * MULTIPLE), max(MULTIPLE, ph // MULTIPLE * MULTIPLE))


def with_controls(tokens: torch.Tensor, ids: torch.Tensor, controls: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's packed tokens and ids followed by each control latent's packed tokens and
    ids (first id coordinate 1), as FluxKontextPipeline builds its transformer input."""
    if not controls:
        return tokens, ids
    parts, all_ids = [tokens], [ids]
    for control in controls:
        control = control.to(tokens.device, tokens.dtype)
        _, _, ch, cw = control.shape
        cids = image_ids(ch, cw, tokens.device, ids.dtype)
        cids[:, 0] = 1
        parts.append(pack(control))
        all_ids.append(cids)
    return torch.cat(parts, dim=1), torch.cat(all_ids, dim=0)


def pipeline_images(images: list[Any], width: int, height: int) -> dict[str, Any]:
    """FluxKontextPipeline arguments for one input image: resized here by `control_size` at the
    output's side (the square root of its area; 1024 for a 1024x1024 output, the pipeline's
    own rule) and passed with `_auto_resize` off, so the pipeline uses it as it is; `max_area`
    keeps the requested output size (the pipeline would otherwise rescale it to 1024x1024)."""
    from PIL import Image

    out: dict[str, Any] = {"max_area": width * height}
    if images:
        image = images[0]
        size = control_size(image.size, round((width * height) ** 0.5))
        if image.size != size:
            image = image.resize(size, Image.Resampling.LANCZOS)
        out.update(image=image, _auto_resize=False)
    return out
