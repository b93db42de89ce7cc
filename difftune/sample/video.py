"""Video samples: a clip's frames written as an mp4 (H.264 through PyAV) and as an animated
WebP preview (Pillow), which browsers play in a plain <img> (the web app's run page shows it).

The first frame is also saved as the sample's PNG, so grids, TensorBoard and every reader of
PNG samples keep working unchanged.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """(F, H, W, 3) floats in [0, 1] -> uint8, rounded."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def write_mp4(frames: np.ndarray, path: Path, fps: float) -> None:
    """(F, H, W, 3) uint8 frames as an H.264 mp4 at `fps` (yuv420p, which players read; the
    sides are multiples of 16 here, as every sample size is), written atomically."""
    import av

    tmp = path.with_name(f".{path.name}.tmp")
    with av.open(str(tmp), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    tmp.replace(path)


def write_preview(frames: np.ndarray, path: Path, fps: float) -> None:
    """(F, H, W, 3) uint8 frames as a looping animated WebP at `fps`, written atomically."""
    images = [Image.fromarray(a) for a in frames]
    tmp = path.with_name(f".{path.name}.tmp")
    images[0].save(tmp, format="WEBP", save_all=True, append_images=images[1:],
                   duration=max(1, round(1000 / fps)), loop=0, quality=80)
    tmp.replace(path)


def write_clip(frames: np.ndarray, png: Path, fps: float, info: Any = None) -> Image.Image:
    """A sampled clip beside its PNG name: `<stem>.mp4`, `<stem>.webp` and the first frame as
    `png` (with `info`, a PngInfo, in it); returns that first frame (for the grid)."""
    data = to_uint8(frames)
    write_mp4(data, png.with_suffix(".mp4"), fps)
    write_preview(data, png.with_suffix(".webp"), fps)
    first = Image.fromarray(data[0])
    first.save(png, pnginfo=info)
    return first
