"""Video clips through the real CLI on the tiny Wan flavor: `check`'s bucket, frame-rate and
skip reports (a source at another rate, a corrupt video, one shorter than every frame count,
one without a caption), clip training with latents that carry a frame axis, and exact resume.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from difftune.cli import main
from tests.videos import frame, record_entries, write_video

from .conftest import assert_same_lora, run_toml, stopped_and_resumed

CLIPS = 'frames = [6, 9]\nclips = "chunks"\n'


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two usable videos (one at 24 fps, resampled to Wan's 16), mixed with an image, and
    three that are skipped: corrupt, too short, no caption."""
    folder = tmp_path_factory.mktemp("videos")
    write_video(folder / "fast.mp4", 30, fps=24)
    write_video(folder / "plain.webm", 12, fps=16, caption="a bar in webm")
    write_video(folder / "short.mp4", 3)
    write_video(folder / "silent.mp4", 12, caption=None)
    (folder / "broken.mp4").write_bytes(b"not a video" * 40)
    (folder / "broken.txt").write_text("broken", encoding="utf-8")
    from PIL import Image

    Image.new("RGB", (64, 48), (200, 30, 30)).save(folder / "still.png")
    (folder / "still.txt").write_text("a red still", encoding="utf-8")
    (folder / "frames").mkdir()  # a folder of frames, its caption beside it
    for i in range(6):
        Image.fromarray(frame(i, 64, 48)).save(folder / "frames" / f"{i:04d}.png")
    (folder / "frames.txt").write_text("frames of a bar", encoding="utf-8")
    return folder


def _config(folder: Path, data: Path, steps: int = 4) -> Path:
    """A tiny Wan run on `data` with clips of 5 or 9 frames taken in chunks."""
    cfg = run_toml(folder, data, family="wan", steps=steps, fmt=None)
    text = cfg.read_text(encoding="utf-8").replace("max_side = 128\n", "max_side = 128\n" + CLIPS)
    cfg.write_text(text, encoding="utf-8")
    return cfg


def test_check_reports_buckets_rates_and_skipped_clips(
        videos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(_config(tmp_path, videos))]) == 0
    out = capsys.readouterr().out
    # 30 frames at 24 fps = 20 at 16: two 9-frame chunks; 12 at 16 fps: one; 6 frames in a
    # folder: one of 5; the image: F = 1 (its frames are not images of their own).
    assert "dataset: 1 images" in out and "bucket 80x48x9: 3" in out and "bucket 80x48: 1" in out
    assert "bucket 80x48x5: 1" in out and "clips: 4 from 3 video(s)" in out
    assert "frames rounded down to 4N+1" in out and "6 -> 5" in out
    assert f"{videos / 'fast.mp4'}: 24 fps resampled to 16 fps" in out
    assert "plain.webm: 16 fps" not in out
    skipped = {line.split(": ", 1)[0].split("/")[-1]: line for line in out.splitlines()
               if line.strip().startswith("skipped")}
    assert "unreadable video" in skipped["broken.mp4"]
    assert "too short: 3 frames" in skipped["short.mp4"]
    assert "no caption" in skipped["silent.mp4"]
    assert "clip memory: the longest clip (9 frames, 3 latent frames, at 64x64)" in out
    # the dataset report: the folder of frames is one of the videos, its frames no images
    # (so neither near-duplicates of each other nor missing their own captions)
    report = next(line for line in out.splitlines() if "dataset report:" in line)
    assert "dataset report: 1 image(s), 6 video(s) (" in report
    assert "near-duplicate" not in report and "captions missing" not in report


def test_clips_train_with_a_frame_axis_and_resume_exactly(
        videos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clips (from files and a folder of frames) and an image train in one run; the cached
    clip latents are (16, f, h, w): 9 frames fold into 3 latent frames, 5 into 2. Stopped
    after step 2 and resumed, the run matches one that went through."""
    seen = record_entries(monkeypatch)
    a, b = _config(tmp_path / "a", videos), _config(tmp_path / "b", videos)
    whole, resumed = stopped_and_resumed(a, b, monkeypatch, 2)
    assert {tuple(e["latent"].shape) for _, e in seen} == {(16, 6, 10), (16, 3, 6, 10),
                                                           (16, 2, 6, 10)}
    assert whole == resumed and len(whole) == 4
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in whole)
    assert_same_lora(a.parent / "out", b.parent / "out")


def test_samples_are_short_videos(videos: Path, tmp_path: Path) -> None:
    """A prompt with --f samples a clip: its mp4 (as many frames, rounded to 4N+1) and a
    looping animated WebP beside its first frame's PNG; a prompt without --f is an image."""
    import av
    from PIL import Image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a moving bar --w 32 --h 32 --s 2 --d 1 --f 6\n"
                       "a still bar --w 32 --h 32 --s 2 --d 2\n", encoding="utf-8")
    cfg = run_toml(tmp_path, videos, family="wan", steps=2, fmt=None, prompts=prompts)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    samples = tmp_path / "out" / "samples"
    clip = samples / "step-000002_00_a-moving-bar"
    with av.open(str(clip.with_suffix(".mp4"))) as video:
        frames = [f.to_ndarray(format="rgb24") for f in video.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    with Image.open(clip.with_suffix(".webp")) as preview:
        assert preview.is_animated and preview.n_frames == 5
    with Image.open(clip.with_suffix(".png")) as first:
        assert first.size == (32, 32)
    still = samples / "step-000002_01_a-still-bar"
    assert still.with_suffix(".png").is_file() and not still.with_suffix(".mp4").exists()


def test_clips_are_bucketed_at_every_resolution(
        videos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset with two resolutions takes each clip at both, as it takes each image: its
    (w, h, frames) buckets are listed per resolution."""
    cfg = _config(tmp_path, videos)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace("resolution = 64",
                                                           "resolution = [64, 96]"))
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "resolution 64: 1 images, 4 clips" in out and "resolution 96: 1 images, 4 clips" in out
    assert "bucket 80x48x9: 3" in out and "bucket 112x80x9: 3" in out
    assert "bucket 112x80x5: 1" in out and "clips: 8 from 3 video(s)" in out


@pytest.mark.full_only
def test_clips_train_at_every_resolution(videos: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Both resolutions' clips are encoded (each its own cache entry) and trained."""
    seen = record_entries(monkeypatch)
    cfg = _config(tmp_path, videos, steps=2)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace("resolution = 64",
                                                           "resolution = [64, 96]"))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    shapes = {tuple(e["latent"].shape) for _, e in seen}
    assert {(16, 3, 6, 10), (16, 3, 10, 14), (16, 2, 10, 14)} <= shapes


def _corner(index: int, width: int, height: int) -> np.ndarray:
    """A black frame with a white square in its top-left corner (as stored)."""
    img = np.zeros((height, width, 3), np.uint8)
    img[:16, :16] = 255
    return img


def test_rotated_video_is_decoded_upright(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A phone video stored 64x48 with a 90 degree display rotation is a 48x64 portrait
    clip: bucketed as one, reported by check, and its frames turned counterclockwise (the
    stored top-left corner shows bottom left), as players show it."""
    from difftune.data.video import Clip, first_frame, read_clip

    data = tmp_path / "data"
    data.mkdir()
    phone = write_video(data / "phone.mp4", 5, paint=_corner, rotation=90)
    assert main(["check", str(_config(tmp_path, data))]) == 0
    out = capsys.readouterr().out
    assert f"{phone}: rotated 90 degrees by its metadata; decoded upright at 48x64" in out
    assert "bucket 48x80x5: 1" in out
    clip = read_clip(phone, Clip(0, 5, 16.0, 16.0), (48, 64), (0, 0, 48, 64), False)
    assert clip.shape == (3, 5, 64, 48)
    corners = clip[:, :, [8, 8, -8, -8], [8, -8, 8, -8]].mean(dim=(0, 1))
    assert corners[2] > 0.8 and (corners[[0, 1, 3]] < -0.8).all(), corners
    assert first_frame(phone).size == (48, 64)
