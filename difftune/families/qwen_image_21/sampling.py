"""QwenImage21Pipeline sampling an edit from precomputed embeddings (see `edit.py`).

diffusers 0.42.1's QwenImage21Pipeline.__call__ has no `image_pad_mask` argument, and its
`encode_prompt` refuses `prompt_embeds` with `image` without one. This subclass only fills that
argument in, as the positions the pipeline's own encoding marks (`edit.slots`: the template's
`<|image_pad|>` run, one slot per 32 x 32 pixels of each resized reference); resizing, the
autoencoder, the denoising loop and its KV cache stay the pipeline's.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import QwenImage21Pipeline

from difftune.families.qwen_image_21 import edit


class EmbeddedEditPipeline(QwenImage21Pipeline):
    """QwenImage21Pipeline whose `encode_prompt` derives `image_pad_mask` for precomputed
    embeddings of a prompt read with one condition image."""

    def encode_prompt(self, prompt: Any, image: list[Any] | None = None,
                      device: torch.device | None = None, num_images_per_prompt: int = 1,
                      prompt_embeds: torch.Tensor | None = None,
                      prompt_embeds_mask: torch.Tensor | None = None,
                      image_pad_mask: torch.Tensor | None = None) -> Any:
        """The pipeline's, with the mask of `prompt_embeds`' image slots filled in where it
        is given embeddings and `image` (the resized references) but no mask."""
        if prompt_embeds is not None and image and image_pad_mask is None:
            if len(image) != 1:
                raise ValueError("difftune samples Qwen-Image 2.1 edits with one reference image")
            width, height = image[0].size
            edit.check_size(width, height, self.processor.image_processor)
            count = (width // edit.PIXELS_PER_SLOT) * (height // edit.PIXELS_PER_SLOT)
            row = edit.slots(prompt_embeds.shape[1], edit.image_offset(self.processor.tokenizer),
                             count, prompt_embeds.device)
            image_pad_mask = row.expand(prompt_embeds.shape[0], -1)
        return super().encode_prompt(prompt, image=image, device=device,
                                     num_images_per_prompt=num_images_per_prompt,
                                     prompt_embeds=prompt_embeds,
                                     prompt_embeds_mask=prompt_embeds_mask,
                                     image_pad_mask=image_pad_mask)
