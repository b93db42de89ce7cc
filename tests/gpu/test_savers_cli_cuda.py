"""The memory savers through the CLI on a CUDA device (tiny flavor, bf16): block swap with its
side-stream prefetch, the 8-bit optimizer (and its exact resume), compiled blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main

from ..e2e.conftest import run_toml

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BASE = ['train.device="cuda"', 'precision.mixed="bf16"', 'precision.denoiser="bf16"',
        "train.gradient_checkpointing=true"]


def train(folder: Path, images: Path, *sets: str, extra: list[str] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = run_toml(folder, images, steps=4)
    args = ["train", str(cfg), "--no-progress", *[a for s in BASE + list(sets)
                                                   for a in ("--set", s)]]
    assert main(args + (extra or [])) == 0
    return folder / "out"


def losses(out: Path) -> list[float]:
    return [json.loads(r)["loss"] for r in (out / "metrics.jsonl").read_text().splitlines()]


def test_block_swap_on_cuda_trains_like_the_run_without(tmp_path: Path, images: Path) -> None:
    plain = train(tmp_path / "plain", images)
    swap = train(tmp_path / "swap", images, "train.blocks_to_swap=3")
    assert losses(swap) == pytest.approx(losses(plain), rel=1e-3)
    a, b = load_file(str(plain / "lora.safetensors")), load_file(str(swap / "lora.safetensors"))
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=2e-3) for k in a)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "lion8bit"])
def test_eight_bit_optimizer_trains_and_resumes_exactly(tmp_path: Path, images: Path,
                                                        optimizer: str) -> None:
    pytest.importorskip("bitsandbytes")
    sets = [f'train.optimizer="{optimizer}"', "save.every_n_steps=2"]
    whole = train(tmp_path / "whole", images, *sets)
    part = tmp_path / "part"
    train(part, images, *sets, "train.steps=2")
    (part / "out" / "lora.safetensors").unlink()
    train(part, images, *sets, extra=["--resume", "latest"])
    assert losses(part / "out") == losses(whole)
    a = load_file(str(whole / "lora.safetensors"))
    b = load_file(str(part / "out" / "lora.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compiled_blocks_on_cuda(tmp_path: Path, images: Path) -> None:
    eager = train(tmp_path / "eager", images)
    compiled = train(tmp_path / "compiled", images, "train.compile=true")
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-2)
