"""SD3-only behaviour through the real CLI on the tiny flavor: kohya keys that read back to the
diffusers file's deltas, the flow-matching timestep options, and the refused noise offset."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.adapters.formats import group_modules
from difftune.cli import main
from difftune.families.sd3.keys import kohya_to_diffusers
from difftune.families.sd3.tiny import TINY_SD3_TRANSFORMER_CONFIG

from ..conftest import metrics_rows, run_toml, train_cli


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """An SD3 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="sd3", **kw)


def test_kohya_file_matches_diffusers_file(trained: Callable[[str], Path], images: Path,
                                           tmp_path: Path) -> None:
    """Same seed and data, kohya layout: read back, every module's delta equals the diffusers one.

    This run has no prompt file while the reference run sampled with one: sample prompts
    (encoded into the same text cache) must not change what training sees."""
    ref_out = trained("sd3")
    out = train(tmp_path / "kohya", images, fmt="kohya")
    kohya = load_file(str(out / "lora.safetensors"))
    assert any(k.startswith("lora_unet_joint_blocks_0_x_block_attn_qkv.") for k in kohya)
    assert all(k.startswith("lora_unet_") for k in kohya)
    num_layers = TINY_SD3_TRANSFORMER_CONFIG["num_layers"]
    state, alphas = kohya_to_diffusers(kohya, num_layers=num_layers)
    back = group_modules(state, alphas)
    with safe_open(str(ref_out / "lora.safetensors"), "pt") as f:
        file_alpha = float(f.metadata()["difftune.alpha"])  # = rank: the scale is in lora_B
    ref = group_modules(load_file(str(ref_out / "lora.safetensors")), file_alpha)
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
    rows = metrics_rows(out)
    assert len(rows) == 2 and all(0 < r["loss"] < 100 for r in rows)


def test_noise_offset_refused(tmp_path: Path, images: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="sd3")
    assert main(["train", str(cfg), "--set", "train.noise_offset=0.1"]) == 2
    assert "train.noise_offset" in capsys.readouterr().err
    assert not (tmp_path / "out" / "lora.safetensors").exists()
