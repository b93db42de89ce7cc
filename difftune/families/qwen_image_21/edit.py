"""Qwen-Image 2.1's image-conditioned mode (the "edit" variant): how a reference image is sized,
where its slots sit in the text sequence, and the pipeline that samples it from embeddings.

QwenImage21Pipeline takes `image`: each condition image is resized once (RGBA, LANCZOS) to
`output_resolution` squared in area at its aspect ratio, each side a multiple of 32
(`calculate_dimensions`, Qwen-Image-Edit's rule), and that one size feeds both readers:
Qwen3-VL reads it (composited over white) as `<image1><|vision_start|><|image_pad|>
<|vision_end|>` before the caption in the user turn, one `<|image_pad|>` per 32 x 32 pixels;
the autoencoder encodes it to latents. The transformer reads the encoder's hidden states with
`img_mask` True at the `<|image_pad|>` positions (the pipeline's `image_pad_mask`), and each
such slot is replaced by the reference's 2 x 2 latent tokens (its hidden states there are
dropped; the caption after it has read the image through the encoder's attention). The
reference's tokens come before the target's in `hidden_states` and in `img_shapes`.

What diffusers 0.42.1 lacks: QwenImage21Pipeline.__call__ takes `prompt_embeds` but no
`image_pad_mask`, and its `encode_prompt`, given embeddings and `image`, raises ("Pass
`image_pad_mask` alongside `prompt_embeds`..."). `EmbeddedEditPipeline` only supplies that
mask, computed from the template's layout (`slots`); the rest is the pipeline's own call.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.families.qwen_image.edit import RULE as QWEN_EDIT_RULE
from difftune.families.qwen_image.edit import control_size, dimensions
from difftune.families.qwen_image_21.spec import DROP, IMAGE_PROMPT, TEMPLATE

__all__ = ["control_size", "RULE", "OUTPUT_RESOLUTION", "image_offset", "slots",
           "check_size", "text_images", "pipeline_images"]
RULE = f"qwen21-{QWEN_EDIT_RULE}"
OUTPUT_RESOLUTION = 1024  # QwenImage21Pipeline's default `output_resolution`
PIXELS_PER_TOKEN = 16  # the autoencoder's downscale: one latent token
PIXELS_PER_SLOT = 32  # one `<|image_pad|>`: 2 x 2 merged 16-pixel patches, 2 x 2 latent tokens


def image_offset(tokenizer: Any) -> int:
    """Where the first reference's `<|image_pad|>` tokens start in the encoder's output (the
    system turn dropped): after "<|im_start|>user\\n<image1><|vision_start|>" in the
    tokenizer's pieces (a special token ends the prefix, so it tokenizes as in the whole)."""
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = tokenizer(TEMPLATE.replace("{}", IMAGE_PROMPT.format(1)))["input_ids"]
    return ids.index(pad) - DROP


def slots(length: int, offset: int, count: int, device: torch.device | None = None
          ) -> torch.Tensor:
    """(length,) bool, True at a reference's `count` image slots from `offset`: the pipeline's
    `image_pad_mask` row (its `<|image_pad|>` positions) for one reference."""
    if offset + count > length:
        raise ValueError(f"text embeddings of {length} tokens hold no {count} image slots "
                         f"from {offset}: they were encoded without the reference image")
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    mask[offset:offset + count] = True
    return mask


def check_size(width: int, height: int, images: Any) -> None:
    """Refuse a reference the image processor `images` would rescale for Qwen3-VL (outside
    its pixel bounds): its slots would then not hold the autoencoder's tokens (the pipeline
    fails there too, in the transformer)."""
    low, high = images.size["shortest_edge"], images.size["longest_edge"]
    if not low <= width * height <= high:
        raise ValueError(f"a {width}x{height} reference is outside the processor's "
                         f"{low}..{high} pixels, so Qwen3-VL would read it at another size "
                         "than the autoencoder; choose a dataset resolution (or sample "
                         "output size) whose references fit")


def text_images(images: list[Any]) -> list[Any]:
    """A sample's reference as the pipeline gives it to Qwen3-VL: resized (LANCZOS) to
    `OUTPUT_RESOLUTION` squared in area, sides multiples of 32 (one reference: the last)."""
    from PIL import Image

    return [img.resize(dimensions(OUTPUT_RESOLUTION ** 2, img.size), Image.Resampling.LANCZOS)
            for img in images[-1:]]


def pipeline_images(images: list[Any]) -> dict[str, Any]:
    """The pipeline's `image` (the reference) and the `output_resolution` it sizes it at; none
    for a prompt without a reference (the checkpoint then draws from text alone)."""
    if not images:
        return {}
    return {"image": images[-1], "output_resolution": OUTPUT_RESOLUTION}
