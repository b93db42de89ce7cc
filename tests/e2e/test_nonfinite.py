"""Non-finite losses through the real CLI, quanto-quantized bases, and quantization refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main
from difftune.train import step as train_step

from .conftest import metrics_rows, run_toml


def _poison(monkeypatch: pytest.MonkeyPatch, bad_steps: set[int] | None) -> None:
    """Make the loss NaN on the given micro-batches (all of them when None)."""
    real = train_step.losses.batch_mean
    calls = [0]

    def loss(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        value = real(*args, **kwargs)
        if bad_steps is None or calls[0] in bad_steps:
            return value * float("nan")
        return value

    monkeypatch.setattr(train_step.losses, "batch_mean", loss)


def test_a_nan_step_is_skipped_and_counted(tmp_path: Path, images: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _poison(monkeypatch, {2})
    assert main(["train", str(run_toml(tmp_path, images, steps=4)), "--no-progress"]) == 0
    rows = metrics_rows(tmp_path / "out")
    assert [r["skipped_nonfinite"] for r in rows] == [0, 1, 1, 1]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["step"] != 2)
    lora = load_file(str(tmp_path / "out" / "lora.safetensors"))
    assert all(torch.isfinite(v).all() for v in lora.values())  # the NaN never reached a weight


@pytest.mark.parametrize("mixed, cause", [("fp16", 'precision.mixed = "bf16"'),
                                          ("no", "lower train.lr")])
def test_nan_in_a_row_stops_with_a_lora_and_the_cause(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], mixed: str, cause: str) -> None:
    _poison(monkeypatch, None)
    cfg = run_toml(tmp_path, images, steps=10)
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_nonfinite_steps=3",
                 "--set", f'precision.mixed="{mixed}"']) == 2
    err = capsys.readouterr().err
    assert "not finite for 3 steps in a row" in err and cause in err and "Traceback" not in err
    saved = tmp_path / "out" / "lora-step000003.safetensors"
    assert saved.is_file() and str(saved) in err
    assert [r["step"] for r in metrics_rows(tmp_path / "out")] == [1, 2]  # the third stopped the run


@pytest.mark.parametrize("method", ["qint8", "qfloat8"])
def test_quanto_quantized_base_trains_and_samples(tmp_path: Path, images: Path, prompts: Path,
                                                  method: str) -> None:
    cfg = run_toml(tmp_path, images, steps=2, prompts=prompts)
    assert main(["train", str(cfg), "--no-progress", "--set", 'precision.mixed="bf16"',
                 "--set", f'precision.quantize.denoiser="{method}"',
                 "--set", f'precision.quantize.text_encoders="{method}"']) == 0
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics_rows(tmp_path / "out"))
    assert list((tmp_path / "out" / "samples").glob("step-000002_00_*.png"))
    assert all(".lora_" in k for k in load_file(str(tmp_path / "out" / "lora.safetensors")))


@pytest.mark.parametrize("sets, needle", [
    (['precision.mixed="bf16"', 'precision.denoiser="fp8"', 'precision.quantize.denoiser="int8"'],
     "both shrink the same weights"),
    (['precision.quantize.text_encoders="nf4"', 'train.device="cpu"'], "nf4\" needs a CUDA"),
    (['precision.quantize.denoiser="int4"'], "precision.quantize.denoiser"),
    (['precision.text_encoders="fp8"'], 'needs precision.mixed = "bf16" or "fp16"'),
])
def test_refused_precision_settings(tmp_path: Path, images: Path,
                                    capsys: pytest.CaptureFixture[str], sets: list[str],
                                    needle: str) -> None:
    args = ["check", str(run_toml(tmp_path, images))] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
