"""FLUX.3's reference image (edit training): how it is sized, padded, packed and placed.

Flux3ModularPipeline takes `image=`: one reference is kept whole (Flux3ImageProcessor
`resize_mode="fill"`, BFL's `reference_canvas`): downscaled (keeping its aspect ratio) until its
canvas, its size rounded up to multiples of 16 and clamped to [64, 4096], fits under 4
megapixels, then reflect-padded to that canvas; encoded like the target (FLUX.2's normalized
latents), its tokens are the transformer's `image_cond_hidden_states` with (0, row/2, col/2, -1)
position ids (Flux3PrepareImageCondLatentsStep). Training sizes the canvas with the cap scaled
to the dataset's resolution (4 x resolution squared, sides at most 4 x resolution): at 1024
exactly the pipeline's rule. The pixels are the diffusers image processor's own resize and
padding. Several references (the pipeline's "crop" rule, under 1 megapixel each) are not
trained yet: the spec takes one per pair.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

MULTIPLE = 16  # one token: the VAE's 8x downscale times the 2x2 patchify
MIN_SIDE = 64  # Flux3ImageProcessor._get_canvas_height_width's min_side
SHRINK = 0.995  # the processor backs its scale off by 0.5% until the canvas fits
RULE = f"flux3-canvas/{MULTIPLE}/reflect-fill"


def _canvas_side(side: int, most: int) -> int:
    """A side rounded up to the token grid, clamped to [MIN_SIDE, most]."""
    return min(most, max(MIN_SIDE, -(-side // MULTIPLE) * MULTIPLE))


def scaled_size(image_size: tuple[int, int], resolution: int) -> tuple[int, int]:
    """(width, height) an image of upright `image_size` is scaled to before its padding: the
    processor's `_resize_if_canvas_exceeds_area` with the area cap 4 x `resolution` squared and
    the side cap 4 x `resolution`, in its arithmetic."""
    w, h = image_size
    area, most = 4 * resolution * resolution, 4 * resolution
    scale = min(1.0, math.sqrt(area / (w * h)), most / max(w, h))
    while True:
        sh, sw = (max(1, round(side * scale)) for side in (h, w))
        if _canvas_side(sh, most) * _canvas_side(sw, most) <= area:
            return (sw, sh)
        scale *= SHRINK


def control_size(image_size: tuple[int, int], resolution: int) -> tuple[int, int]:
    """(width, height) of the canvas a reference of upright `image_size` is encoded at."""
    w, h = scaled_size(image_size, resolution)
    return (_canvas_side(w, 4 * resolution), _canvas_side(h, 4 * resolution))


def canvas(image: Any, resolution: int) -> Any:
    """The reference as a PIL image on its canvas: scaled by the processor's resize (when
    `scaled_size` differs from its size) and reflect-padded by its `_resize_and_fill`."""
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

    processor = Flux3ImageProcessor()
    w, h = scaled_size(image.size, resolution)
    if (w, h) != image.size:
        image = processor.resize(image, height=h, width=w)
    cw, ch = control_size(image.size, resolution)
    return processor._resize_and_fill(image, cw, ch)


def load_pixels(path: Path, size: tuple[int, int], resolution: int) -> torch.Tensor:
    """A reference image as a (1, 3, H, W) batch in [-1, 1] on its canvas (`size`, from
    `control_size`), decoded as every training image is."""
    from diffusers.image_processor import VaeImageProcessor

    from difftune.data.images import load_rgb

    image = canvas(load_rgb(path), resolution)
    if image.size != tuple(size):
        raise ValueError(f"{path}: its canvas is {image.size}, not the {tuple(size)} it was "
                         "scanned at; the file changed since (scan the dataset again)")
    array = VaeImageProcessor.pil_to_numpy(image.convert("RGB"))
    return VaeImageProcessor.normalize(VaeImageProcessor.numpy_to_pt(array))


def pipeline_images(images: list[Any], width: int, height: int) -> dict[str, Any]:
    """The pipeline's `image`: the reference on the canvas training at the output's resolution
    gives it (the pipeline's own rule for a 1024 x 1024 output; on a canvas already, the
    pipeline neither scales nor pads it again)."""
    if not images:
        return {}
    return {"image": canvas(images[0], math.isqrt(width * height))}
