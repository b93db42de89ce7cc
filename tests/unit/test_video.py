"""Video clips: planning clips from a video, frame counts rounded to a family's rule,
resampling to the target frame rate, streamed decoding, and cache keys (a clip's key names its
start, frames and rate; an image's key is the one it always was)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from difftune.cache.keys import entry_key, latent_fields
from difftune.data.video import Clip, plan_clips, probe_video, read_clip, round_frames
from tests.videos import frame, write_video


def test_frame_counts_round_down_to_the_rule() -> None:
    """Wan's 4N+1: 16 -> 13, 17 stays, 3 -> 1; no rule keeps every count."""
    assert [round_frames(n, (4, 1)) for n in (16, 17, 3, 81)] == [13, 17, 1, 81]
    assert round_frames(16, None) == 16


@pytest.mark.parametrize(("mode", "expected"), [
    ("head", [(0, 9)]),
    ("chunks", [(0, 9), (9, 9), (18, 9)]),
    ("slide", [(0, 9), (8, 9), (16, 9)]),
    ("uniform", [(0, 9), (10, 9), (19, 9)]),
    ("full", [(0, 25)]),
])
def test_clip_plans(mode: str, expected: list[tuple[int, int]]) -> None:
    """28 frames, counts 5 and 9 (9 fits), stride 8, 3 uniform clips, full up to 25."""
    assert plan_clips(28, [5, 9], mode, 8, 3, 25, (4, 1)) == expected  # type: ignore[arg-type]


def test_a_video_shorter_than_every_frame_count_is_refused_with_the_reason() -> None:
    why = plan_clips(4, [5, 9], "head", 8, 3, 81, (4, 1))
    assert isinstance(why, str) and "too short" in why and "5, 9" in why


def test_resampling_picks_the_source_frame_at_each_target_time() -> None:
    """24 fps to 16: every 1.5 source frames; 8 fps to 16: each source frame twice."""
    assert Clip(0, 5, 16.0, 24.0).source_frames() == [0, 1, 3, 4, 6]
    assert Clip(2, 4, 16.0, 8.0).source_frames() == [1, 1, 2, 2]


def test_read_clip_streams_the_resampled_frames(tmp_path: Path) -> None:
    """A 24 fps video read at 16 fps from frame 2: each clip frame is its source frame
    (lossy H.264, so compared loosely), mirrored when flipped."""
    path = write_video(tmp_path / "v.mp4", 20, fps=24)
    info = probe_video(path)
    assert (info.size, info.fps, info.frames) == ((64, 48), 24.0, 20)
    clip = Clip(2, 5, 16.0, 24.0)
    pixels = read_clip(path, clip, (64, 48), (0, 0, 64, 48), False)
    assert pixels.shape == (3, 5, 48, 64)
    for k, source in enumerate(clip.source_frames()):
        got = ((pixels[:, k].permute(1, 2, 0).numpy() + 1) * 127.5)
        assert np.abs(got - frame(source, 64, 48)).mean() < 6
    flipped = read_clip(path, clip, (64, 48), (0, 0, 64, 48), True)
    assert np.allclose(flipped.flip(-1).numpy(), pixels.numpy())
    with pytest.raises(ValueError, match="ends before"):
        read_clip(path, Clip(10, 9, 16.0, 24.0), (64, 48), (0, 0, 64, 48), False)


def test_a_corrupt_video_is_unreadable(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video" * 40)
    with pytest.raises(ValueError, match="unreadable video"):
        probe_video(bad)


def test_an_image_cache_key_is_unchanged(tmp_path: Path) -> None:
    """The key of an image entry, as computed before clips existed (the literal)."""
    image = tmp_path / "x.png"
    image.write_bytes(b"fixed image bytes")
    fields = latent_fields(family="flux", fingerprint="abc", dtype="float32", image=image,
                           bucket=(64, 48), box=(0, 0, 64, 48), flip=False)
    assert entry_key(fields) == "bcc015dc10c7a110d3b588f8cb44eb46f1ffaf9a4f03a20416b12cdf803d0cb9"


def test_a_clip_key_changes_with_its_start_frames_and_rate(tmp_path: Path) -> None:
    video = write_video(tmp_path / "v.mp4", 12)

    def key(**clip: float) -> str:
        fields = latent_fields(family="wan", fingerprint="abc", dtype="float32", image=video,
                               bucket=(64, 48), box=(0, 0, 64, 48), flip=False,
                               clip={"start": 0, "frames": 5, "fps": 16.0, **clip})
        return entry_key(fields)

    keys = {key(), key(start=4), key(frames=9), key(fps=24.0)}
    assert len(keys) == 4


def test_a_folder_of_frames_key_follows_its_frames(tmp_path: Path) -> None:
    """A folder of frames is hashed by its frames: editing one makes a new key."""
    from PIL import Image

    from difftune.cache.keys import content_hash

    folder = tmp_path / "clip"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(frame(i, 16, 16)).save(folder / f"{i}.png")
    before = content_hash(folder)
    Image.fromarray(frame(7, 16, 16)).save(folder / "1.png")
    assert content_hash(folder) != before


def test_an_image_family_skips_videos_and_frame_folders_stay_images(tmp_path: Path) -> None:
    """Without a clip rule (an image family), a video is skipped with the reason and a folder
    of frames is read as images, as before clips existed; with Wan's rule it is one clip."""
    from PIL import Image

    from difftune.config import DatasetConfig
    from difftune.data.clips import ClipRule
    from difftune.data.discover import build

    write_video(tmp_path / "v.mp4", 20)
    (tmp_path / "walk").mkdir()
    for i in range(5):
        Image.fromarray(frame(i, 64, 48)).save(tmp_path / "walk" / f"{i}.png")
    (tmp_path / "walk.txt").write_text("walking", encoding="utf-8")
    datasets = [DatasetConfig(path=tmp_path, resolution=64, min_side=32, max_side=128,
                              frames=[5])]
    images = build(datasets, 16)
    assert [it.clip for it in images.items] == [None] * 5
    assert images.skipped == [(tmp_path / "v.mp4", "a video, and this model family trains "
                                                   "images only")]
    clips = build(datasets, 16, clips=ClipRule((4, 1), 16.0))
    assert sorted((it.path.name, it.clip.frames) for it in clips.items if it.clip) == [
        ("v.mp4", 5), ("walk", 5)]
    assert all(it.clip is not None for it in clips.items)
