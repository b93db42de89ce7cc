"""SDXL-only behaviour through the real CLI on the tiny flavor: the UNet's extra LoRA targets,
the kohya layout read by diffusers, the DDPM options, its refusals, and the fp16 VAE."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from difftune.cli import main
from difftune.config import ModelConfig
from difftune.families.sdxl.family import SDXLFamily
from difftune.precision.policy import PrecisionPolicy

from ..conftest import metrics_rows, pipeline_image, run_toml, tiny_pipeline, train_cli


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """An SDXL run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="sdxl", **kw)


@pytest.fixture(scope="module")
def trained_kohya(tmp_path_factory: pytest.TempPathFactory, images: Path,
                  family_prompts: Callable[[str], Path]) -> Path:
    """The contract's reference run (same seed, data, prompts and saves), kohya format."""
    return train(tmp_path_factory.mktemp("sdxl_kohya"), images, "save.every_n_steps=2",
                 prompts=family_prompts("sdxl"), fmt="kohya")


def _image(pipe: StableDiffusionXLPipeline) -> torch.Tensor:
    return pipeline_image(pipe, "a red circle", 64, negative_prompt="blurry", guidance_scale=5.0)


def test_diffusers_lora_covers_time_embedding_and_proj_in(trained: Callable[[str], Path]) -> None:
    file = load_file(str(trained("sdxl") / "lora.safetensors"))
    assert any(".time_emb_proj." in k for k in file) and any(".proj_in." in k for k in file)


def test_kohya_file_loads_through_diffusers_and_matches(trained: Callable[[str], Path],
                                                        trained_kohya: Path) -> None:
    kohya = load_file(str(trained_kohya / "lora.safetensors"))
    assert all(k.startswith("lora_unet_") for k in kohya)
    via_kohya, via_diffusers = tiny_pipeline("sdxl"), tiny_pipeline("sdxl")
    via_kohya.load_lora_weights(str(trained_kohya / "lora.safetensors"))
    via_diffusers.load_lora_weights(str(trained("sdxl") / "lora.safetensors"))
    # Every kohya module (one alpha each) became a LoRA layer of the UNet.
    loaded = get_peft_model_state_dict(via_kohya.unet, adapter_name="default_0")
    assert len(loaded) == 2 * sum(k.endswith(".alpha") for k in kohya)
    assert torch.allclose(_image(via_kohya), _image(via_diffusers), atol=1e-5)


def test_ddpm_options_train_with_finite_loss(images: Path, tmp_path: Path) -> None:
    out = train(tmp_path, images, 'train.prediction="v_prediction"', "train.zero_terminal_snr=true",
                "train.min_snr_gamma=5", "train.noise_offset=0.05", steps=2)
    rows = metrics_rows(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_flow_matching_option_refused(images: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="sdxl")
    assert main(["train", str(cfg), "--no-progress", "--set", 'train.timesteps="shift"']) == 2
    assert "train.timesteps" in capsys.readouterr().err


def test_single_file_without_a_tokenizer_folder_is_refused(tmp_path: Path) -> None:
    """A single-file checkpoint (`model.transformer`) with no `model.path` is refused when the
    config loads: tokenizers are never in checkpoints, and the message says what to set."""
    files = {k: tmp_path / f"{k}.safetensors" for k in ("transformer", "vae")}
    with pytest.raises(ValueError, match=r"model\.path is not set: .*\"sdxl\" needs a diffusers "
                       r"folder .* for its tokenizer/ and tokenizer_2/"):
        ModelConfig(family="sdxl", **files)


def test_fp16_vae_encodes_in_fp32_and_keeps_its_weights() -> None:
    family, tiny = SDXLFamily(), ModelConfig(family="sdxl", flavor="tiny")
    cpu = torch.device("cpu")
    half = family.load(tiny, PrecisionPolicy(cpu, None, torch.float32, torch.float32, torch.float16))
    full = family.load(tiny, PrecisionPolicy(cpu, None, torch.float32, torch.float32, torch.float32))
    before = {k: v.clone() for k, v in half.vae.state_dict().items()}
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = family.encode_images(half, pixels)
    assert z.dtype == torch.float16 and half.vae.dtype == torch.float16
    assert all(torch.equal(v, half.vae.state_dict()[k]) for k, v in before.items())
    assert torch.allclose(z.float(), family.encode_images(full, pixels), atol=1e-2)
