"""SD 1.5-only behaviour through the real CLI on the tiny flavor: the kohya layout (its
default) read by StableDiffusionPipeline.load_lora_weights, the DDPM options users rely on
(v-prediction, min-SNR, noise offset) with clip_skip in a run, and a
full fine-tune written as the original single file that diffusers' from_single_file reads."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from difftune.families.sd15.tiny import TINY_SD15_UNET_CONFIG

from ..conftest import metrics_rows, pipeline_image, run_toml, tiny_pipeline, train_cli


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """An SD 1.5 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="sd15", **kw)


def _image(pipe: StableDiffusionPipeline) -> torch.Tensor:
    return pipeline_image(pipe, "a red circle", 64, negative_prompt="blurry", guidance_scale=7.5)


def test_kohya_file_loads_through_diffusers_and_matches(
        trained: Callable[[str], Path], images: Path, tmp_path: Path) -> None:
    """The default layout: kohya names (`lora_unet_`), read by diffusers' kohya converter into
    the same UNet as the contract run's diffusers-layout file (same seed and data; samples
    do not touch the training's random streams, so this run draws none)."""
    kohya_run = train(tmp_path, images, "save.every_n_steps=2", fmt=None)
    kohya = load_file(str(kohya_run / "lora.safetensors"))
    assert kohya and all(k.startswith("lora_unet_") for k in kohya)
    via_kohya, via_diffusers = tiny_pipeline("sd15"), tiny_pipeline("sd15")
    via_kohya.load_lora_weights(str(kohya_run / "lora.safetensors"))
    via_diffusers.load_lora_weights(str(trained("sd15") / "lora.safetensors"))
    loaded = get_peft_model_state_dict(via_kohya.unet, adapter_name="default_0")
    assert len(loaded) == 2 * sum(k.endswith(".alpha") for k in kohya)
    assert torch.allclose(_image(via_kohya), _image(via_diffusers), atol=1e-5)
    assert not torch.allclose(_image(via_kohya), _image(tiny_pipeline("sd15")), atol=1e-4)


def test_ddpm_options_and_clip_skip_train_with_finite_loss(images: Path, tmp_path: Path) -> None:
    out = train(tmp_path, images, 'train.prediction="v_prediction"', "train.min_snr_gamma=5",
                "train.noise_offset=0.05", "model.clip_skip=1", steps=2)
    rows = metrics_rows(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_full_fine_tune_writes_the_original_single_file(images: Path, tmp_path: Path) -> None:
    """`adapter.type = "full"` of the up blocks: the single file (original LDM names, what
    ComfyUI and A1111 load) read by diffusers' from_single_file holds the trained weights."""
    cfg = run_toml(tmp_path, images, steps=2, fmt=None, family="sd15")
    text = cfg.read_text().replace('rank = 4\nalpha = 8\ntargets = "all_linear"\n',
                                   'type = "full"\ntrain_blocks = ["up_blocks.*"]\n')
    cfg.write_text(text)
    from difftune.cli import main

    assert main(["train", str(cfg), "--no-progress"]) == 0
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps(
        {"_class_name": "UNet2DConditionModel", **TINY_SD15_UNET_CONFIG}))
    single = UNet2DConditionModel.from_single_file(
        str(tmp_path / "out" / "lora.safetensors"), config=str(tmp_path / "unet"),
        local_files_only=True).state_dict()
    base = tiny_pipeline("sd15").unet.state_dict()
    changed = [k for k in base if not torch.equal(single[k], base[k])]
    assert changed and all(k.startswith("up_blocks.") for k in changed)
