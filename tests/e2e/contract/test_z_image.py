"""Z-Image-only behaviour through the real CLI on the tiny flavor: another trainer's LoRA names
for --init-lora (the training paths every family takes are in test_training_paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from safetensors.torch import load_file, save_file

from ..conftest import metrics_rows, run_toml, train_exit_code


def test_init_lora_from_ai_toolkit_names(trained: Callable[[str], Path], images: Path,
                                         tmp_path: Path) -> None:
    """ai-toolkit writes Z-Image LoRAs as `diffusion_model.<module>` PEFT keys without alpha:
    starting from such a copy of our file is starting from our file."""
    ours = trained("z_image") / "lora.safetensors"
    theirs = tmp_path / "ai_toolkit.safetensors"
    save_file({k.replace("transformer.", "diffusion_model.", 1): v
               for k, v in load_file(str(ours)).items()}, str(theirs))
    losses = []
    for name, init in (("ours", ours), ("theirs", theirs), ("fresh", None)):
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="z_image")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses.append(metrics_rows(tmp_path / name / "out")[0]["loss"])
    assert losses[0] == losses[1] != losses[2]  # the file's weights were used, read alike


