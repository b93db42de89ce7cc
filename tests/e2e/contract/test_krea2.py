"""Krea 2-only behaviour through the real CLI on the tiny flavor: other trainers' LoRA layouts
for --init-lora, and the original layout read by diffusers like the diffusers one (the training
paths every family takes are in test_training_paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ..conftest import metrics_rows, run_toml, train_cli, train_exit_code


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """A Krea 2 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="krea2", **kw)


def _layouts(ours: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Our diffusers-layout file (scale folded in: alpha = rank) as other trainers write it."""
    from difftune.families.krea2.keys import to_original

    original = to_original(ours, rank=4, alpha=4.0)
    kohya: dict[str, torch.Tensor] = {}
    for key, value in original.items():
        module = "lora_unet_" + key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] \
            .replace(".", "_")
        if key.endswith(".lora_A.weight"):
            kohya[f"{module}.lora_down.weight"] = value
            kohya[f"{module}.alpha"] = torch.tensor(8.0)  # scale 8 / 4: the up factor halved
        else:
            kohya[f"{module}.lora_up.weight"] = value / 2
    return {
        "original": original,
        "ai_toolkit": {k.replace("diffusion_model.", "base_model.model.", 1): v
                       for k, v in original.items()},
        "kohya": kohya,
        "comfy_diffusers": {k.replace("transformer.", "diffusion_model.", 1): v
                            for k, v in ours.items()},
    }


def test_init_lora_reads_other_trainers_layouts(trained: Callable[[str], Path], images: Path,
                                               tmp_path: Path) -> None:
    """Starting from another trainer's copy of our LoRA (the original names with
    `diffusion_model.`, ai-toolkit's `base_model.model.` without alpha, kohya `lora_unet_` with
    alpha, diffusers names under `diffusion_model.`) is starting from our file."""
    ours = trained("krea2") / "lora.safetensors"
    files = {"ours": ours}
    for name, tensors in _layouts(load_file(str(ours))).items():
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(files[name]))
    losses = {}
    for name, init in [*files.items(), ("fresh", None)]:
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="krea2")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses[name] = metrics_rows(tmp_path / name / "out")[0]["loss"]
    fresh = losses.pop("fresh")
    assert all(v == pytest.approx(losses["ours"], rel=1e-6) for v in losses.values()), losses
    assert fresh != losses["ours"]


def test_original_layout_loads_in_diffusers_like_the_diffusers_one(
        trained: Callable[[str], Path], images: Path, tmp_path: Path) -> None:
    """save.format = "kohya" writes the original layout
    (`diffusion_model.blocks.N.attn.wq`); Krea2Pipeline.load_lora_weights converts it and samples
    what the diffusers file gives, and --init-lora reads it as the diffusers file."""
    from ..conftest import pipeline_image, tiny_pipeline

    out = train(tmp_path / "orig", images, 'save.format="kohya"', steps=2)
    tensors = load_file(str(out / "lora.safetensors"))
    assert tensors and all(k.startswith("diffusion_model.") and ".lora_" in k for k in tensors)
    assert any(".attn.wq.lora_A" in k for k in tensors)
    twin = train(tmp_path / "diff", images, steps=2)
    images_ = []
    for path in (out, twin):
        pipe = tiny_pipeline("krea2")
        pipe.load_lora_weights(str(path / "lora.safetensors"))
        images_.append(pipeline_image(pipe))
    torch.testing.assert_close(images_[0], images_[1], rtol=0, atol=1e-5)
    # Our original-layout file (scale folded, metadata alpha 8) starts a run as the diffusers one.
    losses = []
    for name, path in (("from_orig", out), ("from_diff", twin)):
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="krea2")
        assert train_exit_code(cfg, extra=["--init-lora", str(path / "lora.safetensors")]) == 0
        losses.append(metrics_rows(tmp_path / name / "out")[0]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
