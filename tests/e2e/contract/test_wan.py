"""Wan-only behaviour through the real CLI on the tiny flavor: other trainers' LoRA names for
--init-lora (musubi-tuner's, ai-toolkit's), and `check` refusing a Wan 2.1 image-to-video LoRA
on a text-to-video model with the reason (the training paths every family takes are in
test_training_paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli import main
from difftune.families.wan.keys import to_wan

from ..conftest import metrics_rows, run_toml, train_exit_code

# The contract run's diffusers-layout file: rank 4, its trained scale folded into the up
# factors (its metadata's alpha is the rank, scale 1); the copies below mean the same.
ALPHA, RANK = 4.0, 4


def _wan_name(key: str) -> tuple[str, str]:
    """(Wan's module name, the factor) of one of our diffusers-named keys."""
    module, factor, _ = key.removeprefix("transformer.").rsplit(".", 2)
    return str(to_wan(module)), factor


def _musubi(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """musubi-tuner's layout: `lora_unet_<Wan name, underscores>.lora_down/lora_up` + alpha."""
    out = {}
    for key, value in ours.items():
        module, factor = _wan_name(key)
        base = "lora_unet_" + module.replace(".", "_")
        out[f"{base}.{'lora_down' if factor == 'lora_A' else 'lora_up'}.weight"] = value
        out[f"{base}.alpha"] = torch.tensor(ALPHA)
    return out


def _ai_toolkit(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ai-toolkit's layout: `diffusion_model.<Wan name>.lora_A/B.weight`, no alpha (scale 1)."""
    out = {}
    for key, value in ours.items():
        module, factor = _wan_name(key)
        out[f"diffusion_model.{module}.{factor}.weight"] = value
    return out


def test_init_lora_from_other_trainers_names(trained: Callable[[str], Path], images: Path,
                                            tmp_path: Path) -> None:
    """Starting from musubi-tuner's or ai-toolkit's copy of our file is starting from ours."""
    ours = trained("wan") / "lora.safetensors"
    tensors = load_file(str(ours))
    files = {"ours": ours}
    for name, layout in (("musubi", _musubi), ("ai_toolkit", _ai_toolkit)):
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(layout(tensors), str(files[name]))
    losses = {}
    for name, init in [*files.items(), ("fresh", None)]:
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="wan")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses[name] = metrics_rows(tmp_path / name / "out")[0]["loss"]
    assert losses["musubi"] == losses["ai_toolkit"] == losses["ours"] != losses["fresh"]


def test_check_refuses_an_image_to_video_lora_with_the_reason(
        trained: Callable[[str], Path], images: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Wan 2.1 I2V LoRA (its `k_img`/`v_img` projections) on the 2.2 low-noise expert."""
    i2v = _musubi(load_file(str(trained("wan") / "lora.safetensors")))
    for part in ("k_img", "v_img"):
        i2v[f"lora_unet_blocks_0_cross_attn_{part}.lora_down.weight"] = torch.zeros(RANK, 24)
        i2v[f"lora_unet_blocks_0_cross_attn_{part}.lora_up.weight"] = torch.zeros(24, RANK)
    path = tmp_path / "wan21_i2v_style.safetensors"
    save_file(i2v, str(path))
    cfg = run_toml(tmp_path, images, family="wan")
    args = ["check", str(cfg), "--set", 'model.variant="2.2-t2v-a14b-low"']
    assert main(args + ["--init-lora", str(path)]) == 2
    err = capsys.readouterr().err
    assert "image-to-video LoRA" in err and "cross_attn_k_img" in err
    assert "2.2-t2v-a14b-low" in err and "Traceback" not in err
    # The same file without them on the model it was trained on (the default variant) passes.
    ours = trained("wan") / "lora.safetensors"
    assert main(["check", str(cfg), "--init-lora", str(ours)]) == 0


def test_the_low_noise_expert_samples_its_lora_as_trained(images: Path, tmp_path: Path) -> None:
    """Wan 2.2's low-noise expert is WanPipeline's `transformer_2` (`transformer` None):
    `sample --lora` loads the run's file into it (diffusers' loader cannot through
    `load_lora_weights` there) and writes the image the run sampled after its step; in a
    whole A14B pipeline the file loads into the low-noise branch as users load it."""
    import numpy as np
    from PIL import Image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 2 --d 7\n", encoding="utf-8")
    cfg = run_toml(tmp_path, images, steps=1, prompts=prompts, fmt=None, family="wan",
                   model='flavor = "tiny"\nvariant = "2.2-t2v-a14b-low"')
    assert train_exit_code(cfg, "train.lr=5e-2") == 0
    out = tmp_path / "out"

    def pixels(path: Path) -> np.ndarray:
        return np.asarray(Image.open(path).convert("RGB")).astype(int)

    before, after = (pixels(next((out / "samples").glob(f"step-{s:06d}_00_*.png")))
                     for s in (0, 1))
    assert np.abs(before - after).max() >= 4  # the step changed the image: the check is not void
    written = tmp_path / "sampled"
    assert main(["sample", str(cfg), "--lora", str(out / "lora.safetensors"),
                 "--out", str(written)]) == 0
    assert np.array_equal(pixels(next(written.glob("*_00_*.png"))), after)
    _loads_into_the_a14b_low_noise_branch(out / "lora.safetensors")


def _loads_into_the_a14b_low_noise_branch(path: Path) -> None:
    """The expert's file in a whole Wan 2.2 A14B pipeline (both experts): diffusers'
    `load_lora_weights(..., load_into_transformer_2=True)` puts every module's trained change
    into `transformer_2` and nothing into `transformer`."""
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict

    from difftune.adapters.formats import group_modules
    from difftune.families.wan.keys import diffusers_names
    from difftune.families.wan.tiny import build_tiny_wan

    parts = build_tiny_wan("2.2-t2v-a14b-low")
    high = build_tiny_wan("2.1-t2v-14b")["transformer"]
    pipe = WanPipeline(**{**parts, "transformer": high}, boundary_ratio=0.875)
    pipe.load_lora_weights(str(path), load_into_transformer_2=True)
    assert not any("lora" in k for k in high.state_dict())
    loaded = {f"transformer.{k}": v for k, v in
              get_peft_model_state_dict(pipe.transformer_2, adapter_name="default_0").items()}
    state, alphas = diffusers_names(load_file(str(path)), ())
    ours = group_modules(state, {m: alphas.get(m, RANK) for m in {k.rsplit(".", 2)[0]
                                                                   for k in state}})
    theirs = group_modules(loaded, float(RANK))
    assert ours.keys() == theirs.keys()
    for module, pair in ours.items():
        torch.testing.assert_close(theirs[module].delta(), pair.delta(), rtol=1e-5, atol=1e-6)
