"""SDXL end to end through the real CLI on the tiny flavor, checked against diffusers' loaders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.cli import main
from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.sdxl.family import SDXLFamily
from difftune.families.sdxl.tiny import build_tiny_sdxl
from difftune.precision.policy import PrecisionPolicy

from .conftest import run_toml


def sdxl_toml(folder: Path, images: Path, model: str = 'flavor = "tiny"', **kw: object) -> Path:
    """The shared tiny run file, switched to the SDXL family (and `model` as its source)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = run_toml(folder, images, **kw)
    path.write_text(path.read_text().replace('flavor = "tiny"', f'family = "sdxl"\n{model}'))
    return path


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """Train through the CLI and return the output folder."""
    args = ["train", str(sdxl_toml(folder, images, **kw)), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


@pytest.fixture(scope="module")
def sdxl_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prompt with a negative prompt and CFG 5, one with the family's default CFG."""
    path = tmp_path_factory.mktemp("sdxl_prompts") / "prompts.txt"
    path.write_text("a red circle --n blurry --w 64 --h 64 --s 2 --d 1 --l 5\n"
                    "a pink ring --w 64 --h 64 --s 2 --d 2\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, images: Path, sdxl_prompts: Path) -> Path:
    """A sampled run, diffusers format."""
    return train(tmp_path_factory.mktemp("sdxl"), images, prompts=sdxl_prompts)


@pytest.fixture(scope="module")
def trained_kohya(tmp_path_factory: pytest.TempPathFactory, images: Path,
                  sdxl_prompts: Path) -> Path:
    """The same run (same seed and data), kohya format."""
    return train(tmp_path_factory.mktemp("sdxl_kohya"), images, prompts=sdxl_prompts, fmt="kohya")


def _pipeline() -> StableDiffusionXLPipeline:
    pipe = StableDiffusionXLPipeline(**build_tiny_sdxl())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: StableDiffusionXLPipeline) -> torch.Tensor:
    out = pipe("a red circle", negative_prompt="blurry", height=64, width=64,
               num_inference_steps=2, guidance_scale=5.0,
               generator=torch.Generator().manual_seed(0), output_type="pt")
    return out.images


def _rows(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_outputs_samples_and_metadata(trained: Path) -> None:
    assert (trained / "lora.safetensors").is_file()
    rows = _rows(trained)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    samples = sorted(p.name for p in (trained / "samples").glob("step-*_0*.png"))
    assert samples == [f"step-{s:06d}_{i:02d}_{slug}.png" for s in (0, 2, 4)
                       for i, slug in ((0, "a-red-circle"), (1, "a-pink-ring"))]
    with safe_open(str(trained / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["difftune.family"] == "sdxl"
    assert meta["difftune.base_model"] == "difftune/tiny-sdxl"


def test_diffusers_lora_loads_without_leftovers_and_changes_output(trained: Path) -> None:
    pipe = _pipeline()
    before = _image(pipe)
    pipe.load_lora_weights(str(trained / "lora.safetensors"))
    assert not torch.allclose(before, _image(pipe), atol=1e-4)
    file = load_file(str(trained / "lora.safetensors"))
    assert any(".time_emb_proj." in k for k in file) and any(".proj_in." in k for k in file)
    loaded = get_peft_model_state_dict(pipe.unet, adapter_name="default_0")
    assert {f"unet.{k}" for k in loaded} == set(file)
    for key, value in loaded.items():
        assert torch.equal(value, file[f"unet.{key}"])


def test_kohya_file_loads_through_diffusers_and_matches(trained: Path, trained_kohya: Path) -> None:
    kohya = load_file(str(trained_kohya / "lora.safetensors"))
    assert all(k.startswith("lora_unet_") for k in kohya)
    via_kohya, via_diffusers = _pipeline(), _pipeline()
    via_kohya.load_lora_weights(str(trained_kohya / "lora.safetensors"))
    via_diffusers.load_lora_weights(str(trained / "lora.safetensors"))
    # Every kohya module (one alpha each) became a LoRA layer of the UNet.
    loaded = get_peft_model_state_dict(via_kohya.unet, adapter_name="default_0")
    assert len(loaded) == 2 * sum(k.endswith(".alpha") for k in kohya)
    assert torch.allclose(_image(via_kohya), _image(via_diffusers), atol=1e-5)


def test_ddpm_options_train_with_finite_loss(images: Path, tmp_path: Path) -> None:
    out = train(tmp_path, images, 'train.prediction="v_prediction"', "train.zero_terminal_snr=true",
                "train.min_snr_gamma=5", "train.noise_offset=0.05", steps=2)
    rows = _rows(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_check_passes(images: Path, tmp_path: Path, sdxl_prompts: Path) -> None:
    assert main(["check", str(sdxl_toml(tmp_path, images, prompts=sdxl_prompts))]) == 0


def test_diffusers_folder_loads_and_checks(images: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sdxl-base"
    _pipeline().save_pretrained(str(folder), safe_serialization=True)
    cfg = sdxl_toml(tmp_path / "run", images, model=f'path = "{folder.as_posix()}"')
    assert main(["check", str(cfg)]) == 0


def test_flow_matching_option_refused(images: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = sdxl_toml(tmp_path, images)
    assert main(["train", str(cfg), "--no-progress", "--set", 'train.timesteps="shift"']) == 2
    assert "train.timesteps" in capsys.readouterr().err


def test_single_files_refused_with_a_clear_error(tmp_path: Path) -> None:
    files = {k: tmp_path / f"{k}.safetensors" for k in ("transformer", "vae", "clip_l", "t5")}
    policy = PrecisionPolicy(torch.device("cpu"), None, torch.float32, torch.float32,
                             torch.float32)
    with pytest.raises(ModelFileError, match="diffusers"):
        SDXLFamily().load(ModelConfig(family="sdxl", **files), policy)


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
