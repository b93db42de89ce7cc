"""End to end through the real CLI on the tiny flavor: outputs, determinism, diffusers loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.cli import main
from difftune.families.flux.tiny import build_tiny_flux

from .conftest import run_toml


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = run_toml(folder, images, **kw)
    args = ["train", str(cfg), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, images: Path, prompts: Path) -> Path:
    """One run with sampling and intermediate saves, diffusers format."""
    folder = tmp_path_factory.mktemp("run")
    return train(folder, images, "save.every_n_steps=2", prompts=prompts)


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


def test_outputs(trained: Path) -> None:
    names = {p.name for p in trained.iterdir()}
    assert {"lora.safetensors", "lora-step000002.safetensors", "metrics.jsonl",
            "config.resolved.json", "difftune.log", "samples", "tensorboard"} <= names
    rows = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and "lr" in r and "it_per_s" in r for r in rows)
    assert list((trained / "tensorboard").glob("events.out.tfevents.*"))
    samples = sorted(p.name for p in (trained / "samples").glob("step-*_0*.png"))
    # at_start (0), every 2 steps (2), and at the end (4); two prompts each, named by prompt.
    assert samples == [f"step-{s:06d}_{i:02d}_{slug}.png" for s in (0, 2, 4)
                       for i, slug in ((0, "a-red-circle-on-a-blue-background"), (1, "a-pink-ring"))]
    resolved = json.loads((trained / "config.resolved.json").read_text())
    assert resolved["train"]["steps"] == 4 and resolved["adapter"]["rank"] == 4


def test_metadata(trained: Path) -> None:
    with safe_open(str(trained / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["difftune.family"] == "flux"
    assert meta["difftune.base_model"] == "difftune/tiny-flux"
    # diffusers layout: the scale (8/4) is folded into the up factors, so the file's alpha is 4
    assert meta["difftune.rank"] == "4" and meta["difftune.alpha"] == "4.0"
    assert meta["difftune.trained_alpha"] == "8.0"
    assert meta["difftune.steps"] == "4"
    assert json.loads(meta["difftune.dataset"])["images"] == 6
    assert json.loads(meta["difftune.targets"])
    assert meta["difftune.version"]


def _pipeline() -> FluxPipeline:
    parts = build_tiny_flux()
    parts.pop("t5_max_length")
    pipe = FluxPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: FluxPipeline) -> torch.Tensor:
    out = pipe("a red circle on a blue background", height=32, width=32, num_inference_steps=2,
               max_sequence_length=32, generator=torch.Generator().manual_seed(0),
               output_type="pt")
    return out.images


def test_lora_loads_in_diffusers_and_changes_output(trained: Path) -> None:
    pipe = _pipeline()
    before = _image(pipe)
    pipe.load_lora_weights(str(trained / "lora.safetensors"))
    after = _image(pipe)
    assert not torch.allclose(before, after, atol=1e-4)
    # No leftover key: every tensor of the file became a LoRA weight of the model, unchanged.
    file = load_file(str(trained / "lora.safetensors"))
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert {f"transformer.{k}" for k in loaded} == set(file)
    for key, value in loaded.items():
        assert torch.equal(value, file[f"transformer.{key}"])


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
    via_kohya, via_diffusers = _pipeline(), _pipeline()
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
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(0 < r["loss"] < 100 for r in rows)
    assert rows[0]["lr"] < rows[1]["lr"]  # warm-up
    state = load_file(str(out / "lora.safetensors"))
    assert state and all(".attn." in k for k in state)
