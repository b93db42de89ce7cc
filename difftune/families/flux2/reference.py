"""FLUX.2's reference images: how each is sized, cropped, packed and placed.

Flux2KleinPipeline and Flux2Pipeline (diffusers) take `image=` a list of reference images. Each
is scaled down (LANCZOS, sides truncated to integers) to an area of 1024 x 1024 when it holds
more pixels than that, then center-cropped (never stretched) to sides floored to multiples of 16
(the VAE's 8x downscale times the 2x2 patchify), encoded like the target (`encode_images`:
the distribution's mode, patchified, batch-norm normalized), flattened to tokens and appended
after the target's tokens in the order given. Reference number i (from 0) gets position ids
(10 + 10 i, row, col, 0), the target (0, row, col, 0); the transformer's output is cut back to
the target's tokens. These facts were read from diffusers' pipelines; the code is written here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

PIPELINE_SIDE = 1024  # the pipelines' area cap is PIPELINE_SIDE squared
MULTIPLE = 16  # VAE downscale 8 x 2x2 patchify
TIME_STEP = 10  # reference i's first position coordinate is TIME_STEP * (i + 1)
MIN_SIDE = 64  # Flux2ImageProcessor.check_image_input refuses smaller reference images
RULE = f"flux2-area-cap/{MULTIPLE}/center-crop"


def fit_size(image_size: tuple[int, int], area: int) -> tuple[int, int]:
    """The size an image of upright `image_size` is scaled to before its crop: itself when it
    holds at most `area` pixels, else scaled to that area with each side truncated (the
    pipelines' `_resize_to_target_area`, in the same float arithmetic)."""
    w, h = image_size
    if w * h <= area:
        return (w, h)
    scale = math.sqrt(area / (w * h))
    return (int(w * scale), int(h * scale))


def control_size(image_size: tuple[int, int], area: int) -> tuple[int, int]:
    """(width, height) a reference image of upright `image_size` is encoded at under an area
    cap of `area` pixels: `fit_size` with its sides floored to multiples of 16 (at least 16).
    Training passes the dataset's resolution squared: at resolution 1024 this is exactly the
    pipelines' rule; at another the cap scales with the resolution, as the buckets do."""
    w, h = fit_size(image_size, area)
    return (max(MULTIPLE, w // MULTIPLE * MULTIPLE), max(MULTIPLE, h // MULTIPLE * MULTIPLE))


def load_pixels(path: Path, size: tuple[int, int], resolution: int) -> torch.Tensor:
    """A reference image as a (1, 3, H, W) batch in [-1, 1] at `size` (from `control_size`):
    decoded as every training image is, scaled to `fit_size` when that differs from its size,
    then center-cropped to `size` (Flux2ImageProcessor's crop), in the image processor's
    arithmetic (see `load_control_pixels`)."""
    from difftune.data.images import load_control_pixels, load_rgb

    image = load_rgb(path)
    return load_control_pixels(path, size, fit=fit_size(image.size, resolution * resolution),
                               image=image)


def with_references(tokens: torch.Tensor, ids: torch.Tensor,
                    references: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (B, N, C) tokens and (B, N, 4) ids followed by each reference's tokens and
    ids (references are (B, C, h, w) patchified latents, in order), as the pipelines build
    their transformer input."""
    if not references:
        return tokens, ids
    parts, all_ids = [tokens], [ids]
    for i, ref in enumerate(references):
        ref = ref.to(tokens.device, tokens.dtype)
        b, ch, h, w = ref.shape
        parts.append(ref.reshape(b, ch, h * w).permute(0, 2, 1))
        rid = torch.cartesian_prod(torch.tensor([TIME_STEP * (i + 1)]), torch.arange(h),
                                   torch.arange(w), torch.arange(1))
        all_ids.append(rid.unsqueeze(0).expand(b, -1, -1).to(ids.device, ids.dtype))
    return torch.cat(parts, dim=1), torch.cat(all_ids, dim=1)


def pipeline_images(images: list[Any], width: int, height: int) -> dict[str, Any]:
    """The pipelines' `image` list: each reference scaled and cropped here by `control_size` at
    the output's area (the pipelines' own rule for a 1024 x 1024 output), so that sampling sees
    what training at that resolution sees; a reference the rule would bring under the
    pipelines' 64-pixel minimum side is passed as it is (the pipeline then sizes it itself)."""
    from PIL import Image

    if not images:
        return {}
    out = []
    for image in images:
        w, h = fit_size(image.size, width * height)
        size = control_size(image.size, width * height)
        if min(size) >= MIN_SIDE and image.size != size:
            if (w, h) != image.size:
                image = image.resize((w, h), Image.Resampling.LANCZOS)
            left, top = (w - size[0]) // 2, (h - size[1]) // 2
            image = image.crop((left, top, left + size[0], top + size[1]))
        out.append(image)
    return {"image": out}
