"""Tiny random DINOv2 and CLIP models saved as ordinary local folders (tests and benches).

They are the real transformers classes (`Dinov2Model`, `CLIPModel`) with tiny configs and
random weights, saved with an image processor and (CLIP) the tiny flavors' shipped offline
tokenizer, so `[metrics]` loads them exactly as it loads downloaded ones: nothing is fetched.
"""

from __future__ import annotations

from pathlib import Path

import torch

SIZE = 32  # the processors' square input side


def _image_processor_kwargs() -> dict:
    """A DINOv2-style processor: resize the short side, center crop, ImageNet normalization."""
    return {"size": {"shortest_edge": SIZE}, "crop_size": {"height": SIZE, "width": SIZE},
            "do_center_crop": True, "do_convert_rgb": True,
            "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def save_tiny_dino(folder: Path, seed: int = 0) -> Path:
    """A tiny random `Dinov2Model` with its `BitImageProcessor` in `folder`; the folder.

    Its weights are drawn 10x wider than transformers' default (initializer_range 0.2): at the
    default, the class token and position embeddings swamp the image's patches and every
    image maps to nearly one feature (the demo's images at 0.87 mean similarity); at 0.2 the
    features follow the content (0.15 mean, a noised copy of an image still above 0.99)."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, image_size=SIZE, patch_size=8,
                          initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Dinov2Model(config)
    model.save_pretrained(folder)
    BitImageProcessor(**_image_processor_kwargs()).save_pretrained(folder)
    return folder


def save_tiny_clip(folder: Path, seed: int = 3) -> Path:
    """A tiny random `CLIPModel` with a `CLIPProcessor` (the shipped offline tokenizer) in
    `folder`; the folder. At the default seed most image-prompt cosines are positive (a
    random CLIP's embeddings share a direction: at seed 0 every cosine is negative, and every
    CLIP score would be 0), so a score is a number a test can check."""
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor,
                              CLIPVisionConfig)

    from difftune.families.common.tiny import load_tiny_tokenizers, tiny_clip_config

    tokenizer = load_tiny_tokenizers()[0]
    text = tiny_clip_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=SIZE, patch_size=8,
                              projection_dim=32)
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                        projection_dim=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    model.save_pretrained(folder)
    images = CLIPImageProcessor(**_image_processor_kwargs())
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder
