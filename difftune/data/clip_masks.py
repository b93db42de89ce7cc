"""Loss masks of video clips: finding a clip's mask, checking it against its video, and
preparing it frame by frame exactly as the clip's frames are prepared.

A clip's mask has the same path relative to the subset's `mask_path` as its video, extension
aside: a mask video (decoded like the clip: the same source frames, so the same frame-rate
resampling), a folder of mask frames (for a folder of frames, or a video), or one still mask
image applied to every frame. A mask video or folder must have its source's frame count and
size, a still mask its size; anything else is a `DataError` naming both files. Each frame then
goes through the image masks' steps (`masks.fit_mask`), and the (F, H, W) mask is reduced to the
latent grid in space (area averaging) and in time as the video VAE folds frames: latent frame 0
is frame 0 alone, each later one the mean of the `step` frames it encodes (Wan: frames
4k-3..4k), `step` following from the frame and latent-frame counts.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from difftune.data.buckets import Bucket
from difftune.data.images import IMAGE_EXTENSIONS
from difftune.data.masks import _decoded, fit_mask, to_latent_grid
from difftune.data.video import (VIDEO_EXTENSIONS, Clip, VideoInfo, even_frames, frame_files,
                                 probe_frames, probe_video, stream_images)


def find_clip_mask(video: Path, root: Path, folder: Path) -> Path | str:
    """The mask of `video` (a file or a folder of frames under `root`) in `folder`: a video,
    a folder of frames or an image of the same relative path; or why none is usable."""
    rel = video.relative_to(root).with_suffix("") if video.is_file() else video.relative_to(root)
    found = sorted(p for p in map(Path, glob.glob(glob.escape(str(folder / rel)) + ".*"))
                   if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
    if (folder / rel).is_dir():
        found.append(folder / rel)
    if not found:
        return (f"no mask {rel.as_posix()}.* (a video, an image, or a folder of frames "
                f"{rel.as_posix()}/) in {folder}")
    if len(found) > 1:
        return f"several masks match it in {folder}: {[p.name for p in found]}; keep one"
    return found[0]


def mask_problem(video: Path, mask: Path, info: VideoInfo) -> str | None:
    """Why `mask` cannot mask `video` (probed as `info`): unreadable, or another size or frame
    count; None when it fits. Both files are named."""
    try:
        if mask.is_dir():
            probed = probe_frames(mask, info.fps)
        elif mask.suffix.lower() in VIDEO_EXTENSIONS:
            probed = probe_video(mask)
        else:
            probed = VideoInfo(size=_decoded(mask).size, fps=info.fps, frames=info.frames)
    except (ValueError, OSError) as err:
        return f"its mask {mask} is unreadable: {err}"
    if probed.size != info.size:
        return (f"its mask {mask} is {probed.size[0]}x{probed.size[1]} while {video} is "
                f"{info.size[0]}x{info.size[1]}; make the mask the video's size")
    if probed.frames != info.frames:
        return (f"its mask {mask} has {probed.frames} frames while {video} has {info.frames}; "
                "give the mask one frame per video frame (or one still image for all)")
    return None


def clip_mask_frames(mask: Path, wanted: list[int]) -> Iterator[Image.Image]:
    """The "L" mask frames at the source frame indices `wanted` (a clip's
    `source_frames()`), one at a time: streamed from a mask video, read from a folder, or the
    still image repeated. Raises ValueError when a mask video ends before the last."""
    if mask.is_dir():
        files = frame_files(mask)
        yield from (_decoded(files[i]).convert("L") for i in wanted)
    elif mask.suffix.lower() in VIDEO_EXTENSIONS:
        count = 0
        for count, img in enumerate(stream_images(mask, wanted), start=1):
            yield img.convert("L")
        if count != len(wanted):
            raise ValueError(f"mask video {mask} ends before frame {wanted[count]}")
    else:
        still = _decoded(mask).convert("L")
        yield from (still for _ in wanted)


def mask_area(mask: Path, samples: int = 8) -> float:
    """The share of a clip mask's pixels trained (0..1), for `check`'s report: the mean of up to
    `samples` frames spread over the mask (a still image: its mean), so that reporting on long
    videos never decodes them whole."""
    frames = 1 if mask.is_file() and mask.suffix.lower() not in VIDEO_EXTENSIONS else (
        probe_frames(mask, 1.0) if mask.is_dir() else probe_video(mask)).frames
    images = clip_mask_frames(mask, even_frames(max(frames, 1), samples))
    return float(np.mean([np.asarray(img, dtype=np.float32).mean() / 255.0 for img in images]))


def load_clip_mask(mask: Path, clip: Clip, bucket: Bucket, box: tuple[int, int, int, int],
                   flip: bool) -> torch.Tensor:
    """The (F, H, W) float32 mask in [0, 1] of a clip, aligned frame for frame and pixel for
    pixel with `read_clip(video, clip, bucket, box, flip)`; each frame is fitted as it is
    decoded, so only the clip's frames at their training size are held."""
    frames = clip_mask_frames(mask, clip.source_frames())
    return torch.stack([fit_mask(img, bucket, box, flip) for img in frames])


def to_latent_frames(mask: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """An (F, H, W) pixel mask reduced to the (f, h, w) latent grid: each frame by area
    averaging, then frame 0 alone and each later latent frame the mean of the (F - 1) / (f - 1)
    frames the VAE folds into it."""
    f, h, w = grid
    frames = mask.shape[0]
    if f == 1 and frames == 1:
        return to_latent_grid(mask[0], (h, w))[None]
    step, rest = divmod(frames - 1, f - 1) if f > 1 else (0, 1)
    if rest or step < 1:
        raise ValueError(f"{frames} mask frames do not fold into {f} latent frames")
    spatial = torch.stack([to_latent_grid(m, (h, w)) for m in mask])
    later = spatial[1:].reshape(f - 1, step, h, w).mean(dim=1)
    return torch.cat([spatial[:1], later])
