"""Qwen-Image-only behaviour through the real CLI on the tiny flavor: other trainers' LoRA
layouts for --init-lora (the training paths every family takes are in test_training_paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..conftest import metrics_rows, run_toml, train_exit_code


def _kohya(key: str) -> str:
    """kohya/musubi-tuner's name for a diffusers LoRA key: `lora_unet_` and the module path
    with underscores, `lora_down`/`lora_up` factors."""
    module, factor = key.removeprefix("transformer.").rsplit(".lora_", 1)
    down = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[factor]
    return f"lora_unet_{module.replace('.', '_')}.{down}"


def _layouts(ours: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Our LoRA as other trainers write it for Qwen-Image."""
    # Alpha = rank: our files fold the scale into the up factors (their metadata says so; these
    # copies have none), so that is the alpha of the delta they hold.
    alpha = float(next(v for k, v in ours.items() if k.endswith("lora_A.weight")).shape[0])
    modules = {k.rsplit(".lora_", 1)[0] for k in ours}
    kohya = {_kohya(k): v for k, v in ours.items()}
    kohya.update({f"lora_unet_{m.removeprefix('transformer.').replace('.', '_')}.alpha":
                  torch.tensor(alpha) for m in modules})
    comfy = {k.replace("transformer.", "diffusion_model.", 1).replace("lora_A", "lora_down")
             .replace("lora_B", "lora_up"): v for k, v in ours.items()}
    comfy.update({m.replace("transformer.", "diffusion_model.", 1) + ".alpha":
                  torch.tensor(alpha) for m in modules})
    return {
        "ai_toolkit": {k.replace("transformer.", "diffusion_model.", 1): v
                       for k, v in ours.items()},
        "comfy": comfy,
        "kohya": kohya,
    }


def test_init_lora_from_other_trainers_layouts(trained: Callable[[str], Path], images: Path,
                                               tmp_path: Path) -> None:
    """ai-toolkit's `diffusion_model.<module>` PEFT keys without alpha, ComfyUI-style
    `lora_down`/`lora_up` with alphas, and kohya/musubi-tuner's `lora_unet_` names: starting
    from such a copy of our file is starting from our file."""
    ours = trained("qwen_image") / "lora.safetensors"
    files = {"ours": ours}
    for name, tensors in _layouts(load_file(str(ours))).items():
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(files[name]))
    losses = {}
    for name, init in [*files.items(), ("fresh", None)]:
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="qwen_image")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses[name] = metrics_rows(tmp_path / name / "out")[0]["loss"]
    assert losses["ours"] != losses["fresh"]
    for name in ("ai_toolkit", "comfy", "kohya"):
        assert losses[name] == losses["ours"], name  # the file's weights were used, read alike


