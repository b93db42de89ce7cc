"""ERNIE-Image from local files: a diffusers folder in the released layout (the tiny pipeline
saved with save_pretrained), and the single files ComfyUI users keep (Comfy-Org/ERNIE-Image:
the transformer in diffusers' names under the SGM prefix, FLUX.2's autoencoder in the original
layout with its batch-norm statistics, `ministral-3-3b` with the language model's `model.*`
tensors and the tokenizer data ComfyUI stores beside them) over that folder, each equal to the
tiny model it was written from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.ernie_image.files import load_ernie_image_files, load_transformer_file
from difftune.families.ernie_image.tiny import build_tiny_ernie_image

from .conftest import assert_same_weights
from .layouts import to_ldm_vae

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from diffusers import ErnieImagePipeline

    tiny = build_tiny_ernie_image()
    folder = tmp_path_factory.mktemp("ernie") / "ERNIE-Image"
    ErnieImagePipeline(**tiny).save_pretrained(str(folder), safe_serialization=True)
    files = folder.parent
    save_file({f"model.diffusion_model.{k}": v.contiguous()
               for k, v in tiny["transformer"].state_dict().items()},
              str(files / "ernie-image.safetensors"))
    vae, n = tiny["vae"].state_dict(), len(tiny["vae"].config.block_out_channels)
    ldm = to_ldm_vae({k: v for k, v in vae.items() if not k.startswith("bn.")}, n)
    save_file({**ldm, **{k: v.contiguous() for k, v in vae.items() if k.startswith("bn.")}},
              str(files / "flux2-vae.safetensors"))
    language = tiny["text_encoder"].language_model.state_dict()
    text = {f"model.{k}": v.contiguous() for k, v in language.items()}
    text["tekken_model"] = torch.zeros(8, dtype=torch.uint8)  # ComfyUI keeps its tokenizer here
    save_file(text, str(files / "ministral-3-3b.safetensors"))
    return tiny, folder


def test_diffusers_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    parts = load_ernie_image_files(ModelConfig(family="ernie_image", path=folder), FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["scheduler"].config.shift == 4.0
    assert parts["tokenizer"]("a")["input_ids"] == tiny["tokenizer"]("a")["input_ids"]


def test_single_files_over_the_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    cfg = ModelConfig(family="ernie_image", path=folder,
                      transformer=folder.parent / "ernie-image.safetensors",
                      vae=folder.parent / "flux2-vae.safetensors",
                      text_encoder=folder.parent / "ministral-3-3b.safetensors")
    parts = load_ernie_image_files(cfg, FP32)
    assert parts["transformer"].config.rope_axes_dim == tiny["transformer"].config.rope_axes_dim
    for name in ("transformer", "vae"):
        assert_same_weights(parts[name], tiny[name])
    assert_same_weights(parts["text_encoder"], tiny["text_encoder"].language_model)
    ids = torch.tensor([tiny["tokenizer"]("a red circle")["input_ids"]])
    with torch.no_grad():  # the states encode_prompt reads, from the language model alone
        ours = parts["text_encoder"](ids, output_hidden_states=True).hidden_states[-2]
        theirs = tiny["text_encoder"](input_ids=ids, output_hidden_states=True).hidden_states[-2]
    assert torch.equal(ours, theirs)


def test_another_models_file_is_refused_naming_it(saved: tuple[dict, Path]) -> None:
    _, folder = saved
    with pytest.raises(ModelFileError, match="flux2-vae.safetensors.*ERNIE-Image transformer"):
        load_transformer_file(folder.parent / "flux2-vae.safetensors", torch.float32)
