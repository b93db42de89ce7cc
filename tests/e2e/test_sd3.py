"""SD3 end to end through the real CLI on the tiny flavor: outputs, diffusers loading, kohya keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.adapters.formats import group_modules
from difftune.cli import main
from difftune.families.sd3.keys import kohya_to_diffusers
from difftune.families.sd3.tiny import TINY_SD3_TRANSFORMER_CONFIG, build_tiny_sd3

from .conftest import run_toml


def sd3_toml(folder: Path, images: Path, **kw: object) -> Path:
    """A tiny run file switched to the SD3 family."""
    folder.mkdir(parents=True, exist_ok=True)
    path = run_toml(folder, images, **kw)
    path.write_text(path.read_text().replace('flavor = "tiny"', 'family = "sd3"\nflavor = "tiny"'))
    return path


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """Train through the CLI and return the output folder."""
    args = ["train", str(sd3_toml(folder, images, **kw)), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


@pytest.fixture(scope="module")
def sd3_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prompt with a negative prompt and CFG 4 (so the negative is used)."""
    path = tmp_path_factory.mktemp("sd3prompts") / "prompts.txt"
    path.write_text("a red circle --w 32 --h 32 --s 2 --l 4 --n blurry\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, images: Path, sd3_prompts: Path) -> Path:
    """One sampled run, diffusers format."""
    return train(tmp_path_factory.mktemp("sd3run"), images, prompts=sd3_prompts)


def test_outputs(trained: Path) -> None:
    names = {p.name for p in trained.iterdir()}
    assert {"lora.safetensors", "metrics.jsonl", "samples"} <= names
    rows = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["loss"] < 100 for r in rows)
    samples = sorted(p.name for p in (trained / "samples").glob("step-*_0*.png"))
    assert samples == [f"step-{s:06d}_00_a-red-circle.png" for s in (0, 2, 4)]
    with safe_open(str(trained / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["difftune.family"] == "sd3"
    assert meta["difftune.base_model"] == "difftune/tiny-sd3"


def _pipeline() -> StableDiffusion3Pipeline:
    parts = build_tiny_sd3()
    parts.pop("t5_max_length")
    pipe = StableDiffusion3Pipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: StableDiffusion3Pipeline) -> torch.Tensor:
    out = pipe("a red circle", height=32, width=32, num_inference_steps=2,
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


def test_kohya_file_matches_diffusers_file(trained: Path, images: Path, sd3_prompts: Path,
                                           tmp_path: Path) -> None:
    """Same seed and data, kohya layout: read back, every module's delta equals the diffusers one.

    This run has no prompt file while `trained` sampled with one: sample prompts (encoded into
    the same text cache) must not change what training sees."""
    out = train(tmp_path / "kohya", images, fmt="kohya")
    kohya = load_file(str(out / "lora.safetensors"))
    assert any(k.startswith("lora_unet_joint_blocks_0_x_block_attn_qkv.") for k in kohya)
    assert all(k.startswith("lora_unet_") for k in kohya)
    num_layers = TINY_SD3_TRANSFORMER_CONFIG["num_layers"]
    state, alphas = kohya_to_diffusers(kohya, num_layers=num_layers)
    back = group_modules(state, alphas)
    with safe_open(str(trained / "lora.safetensors"), "pt") as f:
        file_alpha = float(f.metadata()["difftune.alpha"])  # = rank: the scale is in lora_B
    ref = group_modules(load_file(str(trained / "lora.safetensors")), file_alpha)
    assert back.keys() <= ref.keys()
    for module, pair in ref.items():
        # The reader leaves out all-zero parts of fused modules. The last block is context
        # "pre-only": its context queries feed nothing, so that LoRA never trains (up stays 0).
        got = back[module].delta() if module in back else torch.zeros_like(pair.delta())
        assert torch.allclose(got, pair.delta(), atol=1e-6), module
    assert len(back) >= len(ref) - 1


@pytest.mark.parametrize("sets", [('train.timesteps="shift"', "train.shift=3"),
                                  ('train.timesteps="flux_shift"',)])
def test_timestep_sampling(sets: tuple[str, ...], images: Path, tmp_path: Path) -> None:
    out = train(tmp_path, images, *sets, 'adapter.targets="attention"', steps=2)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < r["loss"] < 100 for r in rows)


def test_check_passes(tmp_path: Path, images: Path, sd3_prompts: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(sd3_toml(tmp_path, images, prompts=sd3_prompts))]) == 0
    out = capsys.readouterr().out
    for part in ("model: difftune/tiny-sd3", "training step: loss", "check passed"):
        assert part in out


def test_noise_offset_refused(tmp_path: Path, images: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = sd3_toml(tmp_path, images)
    assert main(["train", str(cfg), "--set", "train.noise_offset=0.1"]) == 2
    assert "train.noise_offset" in capsys.readouterr().err
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_check_on_a_diffusers_folder(tmp_path: Path, images: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """model.path: the tiny model saved in the stable-diffusion-3.5 diffusers layout."""
    folder = tmp_path / "tiny-sd3"
    _pipeline().save_pretrained(folder)
    cfg = run_toml(tmp_path, images)
    cfg.write_text(cfg.read_text().replace(
        'flavor = "tiny"', f'family = "sd3"\npath = "{folder.as_posix()}"'))
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "model: tiny-sd3" in out and "check passed" in out
