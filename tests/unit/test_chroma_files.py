"""Chroma's real model facts: Chroma1-HD's transformer config builds on the meta device with its
published size, and the config read back from a state dict's shapes is the same config."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ChromaTransformer2DModel

from difftune.families.chroma.files import TRANSFORMER_CONFIG, _transformer_config


def test_chroma1_hd_transformer_builds_on_meta_with_its_parameter_count() -> None:
    with torch.device("meta"):
        model = ChromaTransformer2DModel(**TRANSFORMER_CONFIG)
    assert sum(p.numel() for p in model.parameters()) == 8_899_983_424  # "8.9B"


def test_config_from_shapes_equals_the_released_config() -> None:
    with torch.device("meta"):
        model = ChromaTransformer2DModel(**TRANSFORMER_CONFIG)
    read = _transformer_config(model.state_dict(), Path("chroma.safetensors"))
    assert read == {**TRANSFORMER_CONFIG, "out_channels": 64}
