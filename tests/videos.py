"""Tiny test videos written with PyAV: moving colour bars, each frame different, so a clip's
frames (and a resampled one's) can be told apart."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import pytest


def frame(index: int, width: int, height: int) -> np.ndarray:
    """Frame `index`: a gradient whose brightness and a bar's position move with the index."""
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = (index * 9) % 256
    img[..., 1] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    img[:, (index * 3) % width, 2] = 255
    return img


def write_video(path: Path, frames: int, fps: int = 16, width: int = 64, height: int = 48,
                caption: str | None = "a moving bar",
                paint: Callable[[int, int, int], np.ndarray] | None = None,
                rotation: int = 0) -> Path:
    """An H.264 mp4 (or a VP9 webm for a .webm path) of `frames` frames at `fps` (each made by
    `paint(index, width, height)`, `frame` by default), with a same-stem caption file unless
    `caption` is None. `rotation` (counterclockwise degrees) is written as the stream's display
    matrix, as phones write portrait videos."""
    import av

    codec = "libvpx-vp9" if path.suffix == ".webm" else "libx264"
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        for i in range(frames):
            picture = av.VideoFrame.from_ndarray((paint or frame)(i, width, height),
                                                  format="rgb24")
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def record_entries(monkeypatch: "pytest.MonkeyPatch") -> list[tuple[Any, dict]]:
    """Every (item, entry) the run's `LatentSource` encodes from now on (the test's
    monkeypatch undoes the recording), to look at the latents and masks it caches."""
    from difftune.cache.sources import LatentSource

    seen: list[tuple[Any, dict]] = []
    real = LatentSource._encode

    def recording(self: LatentSource, item: Any, box: Any, flip: bool) -> dict:
        entry = real(self, item, box, flip)
        seen.append((item, entry))
        return entry

    monkeypatch.setattr(LatentSource, "_encode", recording)
    return seen
