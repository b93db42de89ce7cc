"""Qwen-Image 2.1 from local files: a diffusers folder in the released layout (the tiny pipeline
saved with save_pretrained: processor/, vae/, text_encoder/, transformer/, scheduler/), the
transformer from one file in the original checkpoint's layout (gate and up projections fused,
as diffusers' single-file converter reads it) over that folder, and Turbo's folder told apart
by the sampling grid its model_index.json ships."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from difftune import families
from difftune.config import ModelConfig
from difftune.families.qwen_image_21.files import load_qwen_image_21_files, single_file_layout
from difftune.families.qwen_image_21.tiny import build_tiny_qwen_image_21
from difftune.files.single import write_layout

from .conftest import assert_same_weights

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The tiny pipeline saved as a diffusers folder, and its transformer as one file in the
    original layout under ComfyUI's `model.diffusion_model.` prefix."""
    from diffusers import QwenImage21Pipeline

    tiny = build_tiny_qwen_image_21()
    folder = tmp_path_factory.mktemp("qwenimage21") / "Qwen-Image-2.1"
    QwenImage21Pipeline(**{k: tiny[k] for k in ("transformer", "vae", "text_encoder",
                                                "processor", "scheduler")}).save_pretrained(
        str(folder), safe_serialization=True)
    layout = {f"model.diffusion_model.{k}": v
              for k, v in single_file_layout(tiny["transformer"]).items()}
    write_layout(folder.parent / "qwen_image_21.safetensors", layout,
                 tiny["transformer"].state_dict(), torch.float32)
    return tiny, folder


def test_diffusers_folder_and_the_original_transformer_file(saved: tuple[dict, Path]) -> None:
    """The folder's parts equal the tiny model's (the tokenizer read from processor/, the text
    encoder read before its final norm); the original-layout file gives the same transformer,
    as diffusers' own from_single_file does, and runs as the original does."""
    from diffusers import QwenImage21Transformer2DModel

    tiny, folder = saved
    parts = load_qwen_image_21_files(ModelConfig(family="qwen_image_21", path=folder), FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["text_encoder"].config.get_text_config().tie_last_hidden_states is False
    assert parts["tokenizer"].get_vocab() == tiny["tokenizer"].get_vocab()
    assert parts["pipeline_options"] == {"sample_sigmas": None}
    single = folder.parent / "qwen_image_21.safetensors"
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        assert "model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight" in f.keys()
    cfg = ModelConfig(family="qwen_image_21", path=folder, transformer=single)
    ours = load_qwen_image_21_files(cfg, FP32)["transformer"]
    assert_same_weights(ours, tiny["transformer"])
    theirs = QwenImage21Transformer2DModel.from_single_file(
        str(single), config=str(folder), subfolder="transformer", torch_dtype=torch.float32)
    assert_same_weights(ours, theirs)
    tokens, text = torch.randn(1, 4, 64), torch.randn(1, 3, 32)
    kw = {"timestep": torch.ones(1), "img_shapes": [[(1, 2, 2)]], "return_dict": False,
          "img_mask": torch.tensor([[False, False, False, True]])}
    with torch.no_grad():  # nothing left on the meta device (RoPE tables, time frequencies)
        torch.testing.assert_close(ours(tokens, text, **kw)[0],
                                   tiny["transformer"](tokens, text, **kw)[0], rtol=0, atol=1e-5)


def test_turbo_folder_is_distilled(saved: tuple[dict, Path], tmp_path: Path) -> None:
    """A model_index.json with `sample_sigmas` (Turbo's) is read as the distilled model."""
    tiny, folder = saved
    turbo = tmp_path / "Qwen-Image-2.1-Turbo"
    turbo.mkdir()
    for part in folder.iterdir():
        (turbo / part.name).symlink_to(part)
    (turbo / "model_index.json").unlink()
    index = json.loads((folder / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.6]}))
    parts = load_qwen_image_21_files(ModelConfig(family="qwen_image_21", path=turbo), FP32)
    assert parts["pipeline_options"] == {"sample_sigmas": [1.0, 0.6]}
    family = families.get("qwen_image_21")
    policy = type("Policy", (), {"device": torch.device("cpu"),
                                 "denoiser_home": torch.device("cpu"), "denoiser": torch.float32,
                                 "vae": torch.float32, "text_encoders": torch.float32})()
    comps = family.components(parts, type("Cfg", (), {"name": None})(), policy)
    assert family.distilled(comps) and "Turbo" in (family.spec.distilled_note or "")


def test_files_no_layout_defines_are_refused(saved: tuple[dict, Path]) -> None:
    """model.vae and model.text_encoder are refused when the config loads (no single-file
    layout of 2.1's autoencoder or Qwen3-VL is defined), and so is a missing folder."""
    _, folder = saved
    for key in ("vae", "text_encoder"):
        with pytest.raises(ValidationError, match=f"model.{key}: .* reads no such file"):
            ModelConfig(family="qwen_image_21", path=folder, **{key: folder / "x.safetensors"})
    with pytest.raises(ValidationError, match="model.path is not set.*processor/"):
        ModelConfig(family="qwen_image_21", transformer=folder.parent / "q.safetensors")
