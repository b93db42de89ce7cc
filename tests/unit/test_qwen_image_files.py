"""Qwen-Image from local files: a diffusers folder in the released layout (the tiny pipeline
saved with save_pretrained), and the ComfyUI single files over that folder (the transformer in
diffusers names with ComfyUI's prefix, the VAE in the Wan-2.1-style layout, Qwen2.5-VL in its
released names), each equal to the tiny model it was written from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.qwen_image.files import SCHEDULER_CONFIG, load_qwen_image_files
from difftune.families.qwen_image.tiny import build_tiny_qwen_image

from .conftest import assert_same_weights

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}
# diffusers resnet parts -> the Wan-2.1 layout's `residual.N` / `shortcut` names.
RESIDUAL = (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."),
            ("norm2.gamma", "residual.3.gamma"), ("conv2.", "residual.6."),
            ("conv_shortcut.", "shortcut."))


def _residual(rest: str) -> str:
    for new, old in RESIDUAL:
        if rest.startswith(new):
            return old + rest[len(new):]
    return rest


def to_wan_vae(key: str) -> str:
    """A diffusers AutoencoderKLQwenImage tensor name in the Wan-2.1-style layout ComfyUI's
    `qwen_image_vae.safetensors` uses (the inverse of diffusers' Wan VAE converter)."""
    plain = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.",
             "encoder.conv_in.": "encoder.conv1.", "decoder.conv_in.": "decoder.conv1.",
             "encoder.norm_out.": "encoder.head.0.", "decoder.norm_out.": "decoder.head.0.",
             "encoder.conv_out.": "encoder.head.2.", "decoder.conv_out.": "decoder.head.2."}
    for new, old in plain.items():
        if key.startswith(new):
            return old + key[len(new):]
    if m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)", key):
        return f"{m[1]}.middle.{2 * int(m[2])}.{_residual(m[3])}"
    if m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", key):
        return f"{m[1]}.middle.1.{m[2]}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key):
        return f"encoder.downsamples.{m[1]}.{_residual(m[2])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        return f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_residual(m[3])}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
        return f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
    raise AssertionError(f"no Wan-layout name for {key}")


def to_released_vl(key: str) -> str:
    """A Qwen2.5-VL tensor name as the released checkpoints write it (`model.`, `visual.`)."""
    return key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from diffusers import QwenImagePipeline

    tiny = build_tiny_qwen_image()
    folder = tmp_path_factory.mktemp("qwenimage") / "Qwen-Image"
    QwenImagePipeline(**tiny).save_pretrained(str(folder), safe_serialization=True)
    files = folder.parent
    state = {k: v.contiguous() for k, v in tiny["transformer"].state_dict().items()}
    save_file(state, str(files / "qwen_image_plain.safetensors"))
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()},
              str(files / "qwen_image_bf16.safetensors"))
    save_file({to_wan_vae(k): v.contiguous() for k, v in tiny["vae"].state_dict().items()},
              str(files / "qwen_image_vae.safetensors"))
    save_file({to_released_vl(k): v.contiguous()
               for k, v in tiny["text_encoder"].state_dict().items()},
              str(files / "qwen_2.5_vl_7b.safetensors"))
    return tiny, folder


def test_diffusers_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    parts = load_qwen_image_files(ModelConfig(family="qwen_image", path=folder), FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["scheduler"].config.max_shift == SCHEDULER_CONFIG["max_shift"] == 0.9
    assert parts["tokenizer"]("<|im_start|>user")["input_ids"] == tiny["tokenizer"](
        "<|im_start|>user")["input_ids"]


def test_single_files_over_the_folder(saved: tuple[dict, Path]) -> None:
    from diffusers import QwenImageTransformer2DModel

    tiny, folder = saved
    cfg = ModelConfig(family="qwen_image", path=folder,
                      transformer=folder.parent / "qwen_image_bf16.safetensors",
                      vae=folder.parent / "qwen_image_vae.safetensors",
                      text_encoder=folder.parent / "qwen_2.5_vl_7b.safetensors")
    parts = load_qwen_image_files(cfg, FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert public(parts["transformer"].config) == public(tiny["transformer"].config)
    # diffusers' own single-file loading of the same transformer reads it alike.
    theirs = QwenImageTransformer2DModel.from_single_file(
        str(folder.parent / "qwen_image_plain.safetensors"), config=str(folder),
        subfolder="transformer", torch_dtype=torch.float32)
    assert_same_weights(parts["transformer"], theirs)
    # They run as the originals do (nothing left on the meta device, e.g. the RoPE tables); up
    # to rounding, as weights read from a file need not share the originals' memory alignment.
    x, text = torch.randn(1, 4, 64), torch.randn(1, 3, 32)
    kw = {"timestep": torch.ones(1), "img_shapes": [[(1, 2, 2)]], "return_dict": False}
    pixels = torch.rand(1, 3, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(parts["transformer"](x, text, **kw)[0],
                                   tiny["transformer"](x, text, **kw)[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(parts["vae"].encode(pixels).latent_dist.mode(),
                                   tiny["vae"].encode(pixels).latent_dist.mode(),
                                   rtol=0, atol=1e-5)
    ids = tiny["tokenizer"](["a red circle"], return_tensors="pt").input_ids
    with torch.no_grad():
        ours = parts["text_encoder"](ids, output_hidden_states=True).hidden_states[-1]
        want = tiny["text_encoder"](ids, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(ours, want)


def test_no_folder_is_refused(saved: tuple[dict, Path]) -> None:
    _, folder = saved
    # Refused when the config loads, naming the folder's tokenizer (no single file holds it).
    with pytest.raises(ValidationError, match="model.path is not set.*tokenizer/"):
        ModelConfig(family="qwen_image", vae=folder.parent / "qwen_image_vae.safetensors",
                    transformer=folder.parent / "qwen_image_bf16.safetensors")


def test_a_wrong_vae_file_is_named(saved: tuple[dict, Path]) -> None:
    _, folder = saved
    cfg = ModelConfig(family="qwen_image", path=folder,
                      vae=folder.parent / "qwen_image_bf16.safetensors")
    with pytest.raises(ModelFileError, match="qwen_image_bf16.safetensors"):
        load_qwen_image_files(cfg, FP32)
