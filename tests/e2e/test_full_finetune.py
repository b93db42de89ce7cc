"""Full fine-tuning through the real CLI on the tiny FLUX.1: exact resume with sharded
checkpoints, trained blocks only, and the diffusers folder it writes (read by diffusers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

from difftune.train.checkpoint import CheckpointManager
from difftune.train.checkpoint.files import read
from tests.e2e.conftest import metrics_rows, run_toml, stopped_and_resumed

FULL = '\n[adapter]\ntype = "full"\ntrain_blocks = ["transformer_blocks.*", "proj_out"]\n'


def _config(folder: Path, images: Path, steps: int = 4) -> Path:
    """The shared tiny run file, turned into a full fine-tune of some blocks."""
    cfg = run_toml(folder, images, steps=steps, fmt=None)
    text = cfg.read_text().replace("[adapter]\nrank = 4\nalpha = 8\ntargets = \"all_linear\"\n",
                                   FULL.lstrip("\n"))
    assert text != cfg.read_text()
    cfg.write_text(text)
    return cfg


def test_full_finetune_resumes_exactly_and_writes_a_diffusers_folder(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small shards, so the weights and the optimizer state are written as several files.
    monkeypatch.setattr(CheckpointManager, "shard_bytes", 48 << 10)
    a, b = _config(tmp_path / "a", images), _config(tmp_path / "b", images)
    sets = ("train.gradient_checkpointing=true", "save.every_n_steps=2", "train.lr=1e-3")
    ra, rb = stopped_and_resumed(a, b, monkeypatch, 2, *sets)
    assert ra == rb  # bitwise equal losses
    ckpt = sorted((tmp_path / "b" / "out" / "checkpoints").iterdir())[-1]
    assert (ckpt / "trainable.safetensors.index.json").is_file()
    assert (ckpt / "optimizer.safetensors.index.json").is_file()
    assert len(list(ckpt.glob("trainable-*.safetensors"))) > 1
    state = read(ckpt).trainable
    assert state and all(k.startswith(("transformer.transformer_blocks.", "transformer.proj_out"))
                         for k in state)
    for run in ("a", "b"):
        model = FluxTransformer2DModel.from_pretrained(tmp_path / run / "out" / "lora"
                                                       / "transformer")
        loaded = model.state_dict()
        for key, value in state.items():
            assert torch.equal(loaded[key.removeprefix("transformer.")], value), key
    frozen = FluxTransformer2DModel.from_pretrained(tmp_path / "a" / "out" / "lora"
                                                    / "transformer").state_dict()
    assert any(k.startswith("single_transformer_blocks.") for k in frozen)
    assert metrics_rows(tmp_path / "b" / "out")[-1]["step"] == 4
