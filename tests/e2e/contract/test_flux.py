"""FLUX.1-only behaviour through the real CLI on the tiny flavor: the kohya layout through
diffusers' converter, determinism, cache settings, and one run mixing accumulation,
checkpointing, bf16, flips, random crops, a cosine schedule and flux_shift timesteps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from safetensors.torch import load_file

from ..conftest import metrics_rows, pipeline_image, tiny_pipeline, train_cli


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """A FLUX.1 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, **kw)


# diffusers' kohya reader splits single_blocks_N_linear1 with the full-size FLUX.1 row counts
# (3072, 3072, 3072, 12288), so on the tiny flavor the converter check trains the double blocks
# only; tests/unit/test_lora_formats.py checks linear1 against diffusers at full size.
DOUBLE_BLOCKS = "adapter.target_modules=[" + ",".join(
    f'"transformer_blocks.{b}.{m}"' for b in (0, 1) for m in (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
        "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
        "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear", "norm1_context.linear")) + "]"


@pytest.fixture(scope="module")
def trained_kohya(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A run on every linear layer of the double blocks (no sampling), in the kohya layout."""
    return train(tmp_path_factory.mktemp("kohya"), images, DOUBLE_BLOCKS, fmt="kohya")


def _image(pipe: FluxPipeline) -> torch.Tensor:
    return pipeline_image(pipe, "a red circle on a blue background")


def test_kohya_file_loads_through_diffusers_converter(trained_kohya: Path, images: Path,
                                                      tmp_path: Path) -> None:
    kohya = trained_kohya / "lora.safetensors"
    keys = set(load_file(str(kohya)))
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.lora_down") for k in keys)
    assert all(k.startswith("lora_unet_") for k in keys)
    converted = FluxPipeline.lora_state_dict(str(kohya))  # raises on any unconsumed key
    assert converted and all(k.startswith("transformer.") for k in converted)
    # Same seed, same data: the diffusers-format run must give the same model through both files.
    ref = train(tmp_path / "ref", images, DOUBLE_BLOCKS)
    via_kohya, via_diffusers = tiny_pipeline("flux"), tiny_pipeline("flux")
    via_kohya.load_lora_weights(str(kohya))
    via_diffusers.load_lora_weights(str(ref / "lora.safetensors"))
    assert torch.allclose(_image(via_kohya), _image(via_diffusers), atol=1e-4)


def test_same_config_and_seed_give_identical_lora(trained_kohya: Path, images: Path,
                                                  tmp_path: Path) -> None:
    again = train(tmp_path / "again", images, DOUBLE_BLOCKS, fmt="kohya")
    a, b = load_file(str(trained_kohya / "lora.safetensors")), load_file(str(again / "lora.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [(p / "metrics.jsonl").read_text().splitlines() for p in (trained_kohya, again)]
    assert [json.loads(l)["loss"] for l in losses[0]] == [json.loads(l)["loss"] for l in losses[1]]
    other = train(tmp_path / "other", images, DOUBLE_BLOCKS, "train.seed=4", fmt="kohya")
    c = load_file(str(other / "lora.safetensors"))
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_cache_settings_do_not_change_training(trained_kohya: Path, images: Path,
                                               tmp_path: Path) -> None:
    """Live encoding every step and cached encoding give bitwise the same run."""
    live = train(tmp_path / "live", images, DOUBLE_BLOCKS, 'cache.latents="none"',
                 'cache.text="none"', fmt="kohya")
    a, b = load_file(str(trained_kohya / "lora.safetensors")), load_file(str(live / "lora.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_accumulation_checkpointing_bf16_flip_and_schedules(images: Path, tmp_path: Path) -> None:
    out = train(tmp_path / "mixed", images, "train.grad_accum=2", "train.gradient_checkpointing=true",
                'precision.mixed="bf16"', 'train.scheduler="cosine"', "train.warmup_steps=1",
                'train.timesteps="flux_shift"', "datasets.0.flip=true", 'datasets.0.crop="random"',
                'adapter.targets="attention"', "adapter.dropout=0.1", steps=3)
    rows = metrics_rows(out)
    assert len(rows) == 3 and all(0 < r["loss"] < 100 for r in rows)
    assert rows[0]["lr"] < rows[1]["lr"]  # warm-up
    state = load_file(str(out / "lora.safetensors"))
    assert state and all(".attn." in k for k in state)
