"""Wan 2.1 I2V 14B (`model.variant = "2.1-i2v-14b"`) through the real CLI on the tiny flavor:
samples conditioned on their own first frame and on its CLIP vision features, exact resume, a
LoRA with the image cross-attention (`k_img`/`v_img`) that ComfyUI's key map and
WanImageToVideoPipeline's loader read as trained, and samples from a start image equal to the
pipeline's own with the file loaded.

One shared run (2 steps) serves the default tests; exact resume (the paths of every family,
with the start-frame entries of the cache) is checked with `--full`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ...comfy_keymap import unmapped
from ..conftest import assert_same_lora, stopped_and_resumed, train_exit_code
from .test_wan22 import _pixels, _same_updates
from .test_wan22_i2v import run_files, start_sampler

I2V = 'flavor = "tiny"\nvariant = "2.1-i2v-14b"'
STEPS, STOP = 2, 1
SAMPLE_STEPS = 3
SETS = ("sample.every_n_steps=100", "sample.at_start=false")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, images: Path) -> dict:
    """Run `a` through."""
    cfgs, start = run_files(tmp_path_factory.mktemp("wan21_i2v"), images, I2V, STEPS,
                            SAMPLE_STEPS)
    assert train_exit_code(cfgs[0], *SETS) == 0
    return {"a": cfgs[0].parent / "out", "start": start}


def test_writes_the_image_cross_attention_in_comfyuis_names(runs: dict) -> None:
    """The file adapts every block's `cross_attn.k_img`/`v_img` (diffusers' add_k_proj /
    add_v_proj), and every key is in ComfyUI's Wan key map."""
    a = load_file(str(runs["a"] / "lora.safetensors"))
    for n in (0, 1):
        for part in ("k_img", "v_img"):
            assert f"diffusion_model.blocks.{n}.cross_attn.{part}.lora_A.weight" in a
    assert unmapped("wan", list(a)) == []


@pytest.mark.full_only
def test_stopped_and_resumed_equals_uninterrupted(images: Path, tmp_path: Path) -> None:
    """Stopped after step 1 and resumed: the same losses and LoRA bitwise."""
    cfgs, _ = run_files(tmp_path, images, I2V, STEPS, SAMPLE_STEPS)
    with pytest.MonkeyPatch.context() as mp:
        whole, resumed = stopped_and_resumed(cfgs[0], cfgs[1], mp, STOP, *SETS)
    assert whole == resumed and len(whole) == STEPS
    assert_same_lora(cfgs[0].parent / "out", cfgs[1].parent / "out")


def test_the_lora_loads_and_samples_as_the_pipeline_does(runs: dict) -> None:
    """In WanImageToVideoPipeline (its CLIP vision encoder reading the start image) the file
    gives every module the update the run trained, and the run's final sample is what that
    pipeline makes from the prompt and the start image (within one 8-bit level: diffusers'
    converter folds alpha / rank into the down factors), not the base model's."""
    from diffusers import WanImageToVideoPipeline

    from difftune.families.wan.tiny import build_tiny_wan

    out = runs["a"]
    pipe = WanImageToVideoPipeline(**build_tiny_wan("2.1-i2v-14b"))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(out / "lora.safetensors"), adapter_name="lora")
    trained = load_file(str(out / f"checkpoints/step-{STEPS:06d}/trainable.safetensors"))
    _same_updates(pipe.transformer, "lora", trained, "transformer.")
    sample = start_sampler(pipe, runs["start"], 5.0, SAMPLE_STEPS)
    ours = _pixels(next((out / "samples").glob(f"step-{STEPS:06d}_00_*.png")))
    assert np.abs(sample() - ours).max() <= 1
    pipe.disable_lora()
    assert np.abs(sample() - ours).max() >= 4
