"""Z-Image from local files: a diffusers folder in the released layout (the tiny pipeline saved
with save_pretrained), and the ComfyUI single files (original-layout transformer with fused qkv,
LDM-layout `ae`, ComfyUI's `qwen_3_4b`) over that folder, each equal to the tiny model it was written from."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.families.z_image.files import load_z_image_files
from difftune.families.z_image.tiny import build_tiny_z_image

from .conftest import assert_same_weights
from .layouts import to_ldm_vae

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}
# diffusers name -> the original (ComfyUI) name, the inverse of diffusers' converter's renames.
RENAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
           (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
           (".attention.norm_q.", ".attention.q_norm."))


def to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers-layout Z-Image transformer state in the original layout (fused qkv)."""
    out = {}
    for key, value in sd.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [sd[key.replace("to_q", n)] for n in ("to_q", "to_k", "to_v")]
            key, value = key.replace("to_q", "qkv"), torch.cat(parts)
        for new, old in RENAMES:
            key = key.replace(new, old)
        out["model.diffusion_model." + key] = value.contiguous()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from diffusers import ZImagePipeline

    tiny = build_tiny_z_image()
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image"
    ZImagePipeline(**tiny).save_pretrained(str(folder), safe_serialization=True)
    files = folder.parent
    save_file(to_original(tiny["transformer"].state_dict()), str(files / "z_image_turbo.safetensors"))
    n = len(tiny["vae"].config.block_out_channels)
    save_file(to_ldm_vae(tiny["vae"].state_dict(), n), str(files / "ae.safetensors"))
    qwen = {f"model.{k}": v.contiguous() for k, v in tiny["text_encoder"].state_dict().items()}
    qwen["lm_head.weight"] = qwen["model.embed_tokens.weight"].clone()  # the causal LM's head
    save_file(qwen, str(files / "qwen_3_4b.safetensors"))
    return tiny, folder


def test_diffusers_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    parts = load_z_image_files(ModelConfig(family="z_image", path=folder), FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["scheduler"].config.shift == 6.0  # the folder's (the tiny flavor is Base)
    assert parts["tokenizer"].chat_template == tiny["tokenizer"].chat_template


def test_single_files_over_the_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    cfg = ModelConfig(family="z_image", path=folder,
                      transformer=folder.parent / "z_image_turbo.safetensors",
                      vae=folder.parent / "ae.safetensors",
                      text_encoder=folder.parent / "qwen_3_4b.safetensors")
    parts = load_z_image_files(cfg, FP32)
    assert parts["transformer"].config.axes_dims == tiny["transformer"].config.axes_dims
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    tok = tiny["tokenizer"]
    ids = tok(["a red circle"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(parts["text_encoder"](ids).last_hidden_state,
                           tiny["text_encoder"](ids).last_hidden_state)
    assert parts["vae"].config.scaling_factor == 0.3611


def test_no_folder_is_refused(tmp_path: Path, saved: tuple[dict, Path]) -> None:
    _, folder = saved
    # Refused when the config loads, naming the folder's tokenizer (no single file holds it).
    with pytest.raises(ValidationError, match="model.path is not set.*tokenizer/"):
        ModelConfig(family="z_image", transformer=folder.parent / "z_image_turbo.safetensors",
                    vae=folder.parent / "ae.safetensors")
