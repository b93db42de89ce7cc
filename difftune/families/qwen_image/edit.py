"""Qwen-Image-Edit's conditioning: how its input images are sized for the VAE and for the
vision-language text encoder, and where their latents go.

QwenImageEditPipeline (diffusers) resizes its one input image to the area 1024 x 1024 at the
image's aspect ratio, each side rounded to a multiple of 32 (`calculate_dimensions`), and both
encodes that image with the VAE (the reference latents) and gives it to Qwen2.5-VL's processor
with the instruction. QwenImageEditPlusPipeline (2509, 2511) takes several images and sizes
each twice by the same rule: at 384 x 384 for the text encoder (CONDITION_IMAGE_SIZE) and at
1024 x 1024 for the VAE (VAE_IMAGE_SIZE). The reference latents are packed like the target's
and follow its tokens; `img_shapes` lists the target's (frames, rows, columns) of patches and
then each reference's; the transformer's output is cut back to the target's tokens. These
facts were read from diffusers' pipelines; the code is written here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from difftune.families.common.latents import pack

MULTIPLE = 32  # the pipelines round each side to a multiple of 32
VAE_AREA = 1024 * 1024  # the reference image's area at the released resolution
CONDITION_AREA = 384 * 384  # the Plus pipeline's text-encoder image area
RULE = f"qwen-edit-area/{MULTIPLE}"


def dimensions(area: float, image_size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of about `area` pixels at `image_size`'s aspect ratio, each side rounded
    to the nearest multiple of 32 (at least 32): the edit pipelines' `calculate_dimensions`."""
    ratio = image_size[0] / image_size[1]
    width = math.sqrt(area * ratio)
    height = width / ratio
    return (max(MULTIPLE, round(width / MULTIPLE) * MULTIPLE),
            max(MULTIPLE, round(height / MULTIPLE) * MULTIPLE))


def control_size(image_size: tuple[int, int], resolution: int) -> tuple[int, int]:
    """The size a reference image is VAE-encoded at for a dataset at `resolution`: about
    resolution squared pixels at its aspect ratio (at 1024, exactly the pipelines' size)."""
    return dimensions(resolution * resolution, image_size)


def text_area(plus: bool) -> int:
    """The area the text encoder reads an input image at: the Plus pipeline's condition size,
    or the edit pipeline's one image size (whatever the training resolution: the text encoder
    reads what the pipeline gives it)."""
    return CONDITION_AREA if plus else VAE_AREA


def text_rule(plus: bool) -> str:
    """The text-image size rule's name (part of text entries' keys)."""
    return f"qwen-edit-text-area/{text_area(plus)}/{MULTIPLE}"


def with_controls(tokens: torch.Tensor, h: int, w: int, controls: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The target's packed tokens followed by each reference latent's packed tokens, and the
    per-sample `img_shapes` entry: the target's (1, rows, columns) of patches, then each
    reference's, as the edit pipelines build the transformer's input."""
    shapes = [(1, h // 2, w // 2)]
    if not controls:
        return tokens, shapes
    parts = [tokens]
    for control in controls:
        control = control.to(tokens.device, tokens.dtype)
        parts.append(pack(control))
        shapes.append((1, control.shape[2] // 2, control.shape[3] // 2))
    return torch.cat(parts, dim=1), shapes


def text_images(images: list[Any], plus: bool) -> list[Any]:
    """Sample input images resized as the pipeline resizes them for its text encoder (LANCZOS,
    diffusers' VaeImageProcessor.resize)."""
    from PIL import Image

    return [img.resize(dimensions(text_area(plus), img.size), Image.Resampling.LANCZOS)
            for img in images]
