"""Masked loss on video clips through the real CLI on the tiny Wan flavor: a mask video, a
folder of mask frames and a still mask image, each reduced to the clip's (f, h, w) latent grid
(latent frame 0 = frame 0, latent frame k = frames 4k-3..4k), and `check` refusing a mask whose
frame count or size differs from its video, naming both files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.cli import main
from tests.videos import frame, record_entries, write_video

from .conftest import run_toml
from .test_masked_loss import prepared_keeping_predictions


def _half(width: int, height: int, left: bool) -> np.ndarray:
    """A gray mask, white on its left (or right) half."""
    mask = np.zeros((height, width), np.uint8)
    mask[:, slice(None, width // 2) if left else slice(width // 2, None)] = 255
    return mask


def _bright_first(index: int, width: int, height: int) -> np.ndarray:
    """Mask video frame `index`: white for the first three frames, black after."""
    return np.full((height, width, 3), 255 if index < 3 else 0, np.uint8)


@pytest.fixture(scope="module")
def masked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Clips with masks: a 9-frame video masked by a mask video, a folder of 5 frames by a
    folder of mask frames (left half), a 5-frame video by one still mask (right half)."""
    root = tmp_path_factory.mktemp("masked")
    data, masks = root / "data", root / "masks"
    data.mkdir(), masks.mkdir()
    write_video(data / "a.mp4", 9)
    write_video(masks / "a.mp4", 9, caption=None, paint=_bright_first)
    write_video(data / "b.mp4", 5)
    Image.fromarray(_half(64, 48, left=False)).save(masks / "b.png")
    (data / "frames").mkdir(), (masks / "frames").mkdir()
    for i in range(5):
        Image.fromarray(frame(i, 64, 48)).save(data / "frames" / f"{i:04d}.png")
        Image.fromarray(_half(64, 48, left=True)).save(masks / "frames" / f"{i:04d}.png")
    (data / "frames.txt").write_text("frames of a bar", encoding="utf-8")
    return data, masks


def _config(folder: Path, data: Path, masks: Path, steps: int = 1) -> Path:
    """A tiny Wan run on `data`, masked by `masks` with unmasked_weight 0, clips of 5 or 9."""
    cfg = run_toml(folder, data, family="wan", steps=steps, fmt=None)
    text = cfg.read_text(encoding="utf-8").replace(
        "max_side = 128\n", f'max_side = 128\nframes = [5, 9]\nmask_path = "{masks.as_posix()}"'
        "\nunmasked_weight = 0\n")
    cfg.write_text(text, encoding="utf-8")
    return cfg


def test_clip_masks_fold_onto_the_latent_frames_and_train(
        masked: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each clip's cached mask is on its latent grid (f, h, w): the mask video's first three
    white frames give latent frame 0 = 1, frame 1 (frames 1-4) = 0.5, frame 2 (5-8) = 0; the
    folder of left-half masks and the still right-half mask hold in every latent frame."""
    seen = record_entries(monkeypatch)
    assert main(["train", str(_config(tmp_path, *masked)), "--no-progress"]) == 0
    entries = {item.path.name: entry for item, entry in seen}
    a, b, folder = entries["a.mp4"]["mask"], entries["b.mp4"]["mask"], entries["frames"]["mask"]
    assert a.shape == (3, 6, 10) and b.shape == folder.shape == (2, 6, 10)
    means = a.mean(dim=(1, 2))
    assert torch.allclose(means, torch.tensor([1.0, 0.5, 0.0]), atol=0.06), means
    assert (folder[..., :4] > 0.95).all() and (folder[..., 6:] < 0.05).all()
    assert (b[..., :4] < 0.05).all() and (b[..., 6:] > 0.95).all()


def test_check_reports_clip_masks_and_refuses_mismatched_ones(
        masked: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, masks = masked
    assert main(["check", str(_config(tmp_path, data, masks))]) == 0
    assert ("masked loss: datasets[0].subsets[0]: 3 clips masked by mask files, mean masked "
            "area 46%"
            in capsys.readouterr().out)
    bad = tmp_path / "bad"
    bad.mkdir()
    write_video(bad / "a.mp4", 7, caption=None, paint=_bright_first)  # 7 frames, not 9
    Image.fromarray(_half(32, 48, left=True)).save(bad / "b.png")  # 32 wide, not 64
    (bad / "frames").mkdir()
    for i in range(5):
        Image.fromarray(_half(64, 48, left=True)).save(bad / "frames" / f"{i:04d}.png")
    assert main(["check", str(_config(tmp_path, data, bad))]) == 2
    err = capsys.readouterr().err
    assert "2 video(s) have no usable mask" in err
    assert f"its mask {bad / 'a.mp4'} has 7 frames while {data / 'a.mp4'} has 9" in err
    assert f"its mask {bad / 'b.png'} is 32x48 while {data / 'b.mp4'} is 64x48" in err


def test_clip_background_gets_no_gradient(masked: tuple[Path, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With unmasked_weight 0, the prediction of the clip masked by the right-half still mask
    gets no gradient on the left of any latent frame, and gets one on the right of each: the
    (f, h, w) mask weighs the (B, C, f, h, w) prediction."""
    from difftune.train.step import batch_loss

    run, seen = prepared_keeping_predictions(_config(tmp_path, *masked), monkeypatch)
    index = next(i for i, it in enumerate(run.data.items) if it.path.name == "b.mp4")
    batch_loss(run, [index], [False], torch.Generator().manual_seed(0)).backward()
    grad = seen[0].grad
    assert grad is not None and grad.shape[-3:] == (2, 6, 10)
    assert torch.all(grad[..., :4] == 0)
    assert torch.all(grad[..., 6:].abs().sum(dim=(0, 1, 3, 4)) > 0)
