"""Per-text-encoder storage dtypes: each encoder in its own dtype, fp8 where asked, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftune.cli import main
from difftune.config import load_config
from difftune.precision.lowbit import Fp8Linear
from difftune.train.setup import fill_caches, prepare
from difftune.train.step import batch_loss

from .conftest import run_toml


def test_each_text_encoder_in_its_own_dtype(tmp_path: Path, images: Path) -> None:
    path = run_toml(tmp_path, images)
    path.write_text(path.read_text().replace('flavor = "tiny"', 'family = "sd3"\nflavor = "tiny"')
                    + '\n[precision]\nmixed = "bf16"\n'
                      'text_encoders = { clip_l = "bf16", t5 = "fp8" }\n')
    run = prepare(load_config(path, ['cache.text="none"']), show_progress=False)
    fill_caches(run, [], show_progress=False)
    te = run.comps.text_encoders
    fp8 = {n: sum(isinstance(m, Fp8Linear) for m in e.modules()) for n, e in te.items()}
    assert fp8["t5"] > 0 and fp8["clip_l"] == fp8["clip_g"] == 0
    assert te["clip_l"].dtype == torch.bfloat16 and te["clip_g"].dtype == torch.float32
    # T5's embedding table and `wo` (declared keep-high) stay out of fp8.
    assert te["t5"].get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(type(m) is torch.nn.Linear for n, m in te["t5"].named_modules() if n.endswith(".wo"))
    loss = batch_loss(run, [0, 1], [False, False], torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_unknown_encoder_in_the_dtype_table_is_refused(tmp_path: Path, images: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = run_toml(tmp_path, images)
    path.write_text(path.read_text() + '\n[precision]\nmixed = "bf16"\n'
                                       'text_encoders = { clip_g = "bf16" }\n')
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "precision.text_encoders: 'clip_g' is not a text encoder" in err
