"""FLUX.3 edit pairs: the reference is sized and padded as Flux3ImageProcessor keeps a single
reference (its own arithmetic at the scaled caps, its `preprocess` at 1024), and predict with it
is the transformer call of the modular pipeline's image-conditioned denoise loop; one edit run
through the real CLI on the bundled pairs checks, trains and samples with --ci."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from difftune import families
from difftune.families.base import Conditioning
from difftune.families.common.bn_vae import patchify
from difftune.families.flux3 import reference
from ..lora_files import tiny as tiny_components


def _image(w: int, h: int) -> Image.Image:
    gen = np.random.default_rng(w * 7919 + h)
    return Image.fromarray(gen.integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_canvas_is_the_image_processors() -> None:
    """At resolution r the canvas is the processor's with its caps set to 4 r^2 and 4 r
    (scaled, padded to the grid, at least 64); at 1024 it is its `preprocess` exactly."""
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

    proc = Flux3ImageProcessor()
    for w, h in ((300, 200), (129, 127), (37, 20), (400, 30), (64, 64)):
        scaled = proc._resize_if_canvas_exceeds_area(_image(w, h), target_area=4 * 64 * 64,
                                                     max_side=256)
        assert reference.scaled_size((w, h), 64) == scaled.size
        ch, cw = proc._get_canvas_height_width(scaled.height, scaled.width, max_side=256)
        assert reference.control_size((w, h), 64) == (cw, ch)
    small = _image(100, 37)  # padded to 112 x 64 (a reflection), not scaled
    want, _ = proc.preprocess(small, resize_mode="fill")
    assert reference.control_size(small.size, 1024) == (want.shape[3], want.shape[2]) == (112, 64)
    ours = reference.canvas(small, 1024)
    assert torch.equal(proc.normalize(proc.numpy_to_pt(proc.pil_to_numpy(ours))), want)

def test_predict_with_a_reference_is_the_pipelines_step(tmp_path: Path) -> None:
    """One image-conditioned step of the modular pipeline from pure noise (guidance off)
    moves the latents by -velocity, the reference encoded and placed by difftune."""
    from diffusers import ClassifierFreeGuidance

    family, comps = families.get("flux3"), tiny_components("flux3")
    image = _image(40, 24)
    image.save(tmp_path / "before.png")
    size = family.control_size(image.size, (32, 32), 1024)
    pixels = family.control_pixels(tmp_path / "before.png", size, 1024)
    cond = Conditioning(1.0, [], [], [], controls=(family.encode_images(comps, pixels),))
    latents = torch.randn(1, 8, 4, 4, generator=torch.Generator().manual_seed(5))
    embeds = family.encode_text(comps, ["make it red"])
    velocity = family.predict(comps, latents, embeds, torch.tensor([1.0]), cond)
    pipe = family.pipeline(comps).embedded
    pipe.update_components(guider=ClassifierFreeGuidance(enabled=False))
    stepped = pipe(prompt_embeds=embeds.tensors["prompt_embeds"], latents=patchify(latents),
                   image=image, height=32, width=32, num_inference_steps=1, output="latents")
    torch.testing.assert_close(stepped, patchify(latents - velocity), rtol=0, atol=1e-6)
    plain = family.predict(comps, latents, embeds, torch.tensor([1.0]),
                           Conditioning(1.0, [], [], []))
    assert not torch.allclose(plain, velocity)
