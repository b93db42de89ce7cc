"""On a CUDA device: a tiny-flavor run in bf16 trains, offloads the encoders and saves a LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftune.config import load_config
from difftune.verbs.train import run_train

from ..e2e.conftest import run_toml

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tiny_run_on_cuda(tmp_path: Path, images: Path) -> None:
    cfg = load_config(run_toml(tmp_path, images), [
        'train.device="cuda"', 'precision.mixed="bf16"', 'precision.denoiser="bf16"',
        'precision.text_encoders="bf16"', "train.gradient_checkpointing=true"])
    result = run_train(cfg, show_progress=False)
    assert result.lora is not None and result.lora.is_file()
    assert all(torch.isfinite(torch.tensor(result.losses)))
