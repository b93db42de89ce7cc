"""Video clips: probing video files, planning the clips a run takes from each, and decoding one
clip's frames, streamed.

A clip lives on the dataset's target frame rate (`fps`): its `start` and `frames` count frames
at that rate, and frame k of a clip shows the source at time (start + k) / fps, which is the
source frame floor(time x source fps). A source at another rate is thereby resampled (frames
dropped or repeated), so motion is trained at the model's speed, never faster or slower.
A folder of frames (images in name order, its caption file beside the folder) is a clip source
too, at the target rate. Decoding streams (PyAV): frames are decoded one by one, each taken
frame is resized to its bucket at once, and nothing else is kept, so memory holds the clip's
frames at their training size and never the whole video.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from PIL import Image

from difftune.data.buckets import Bucket
from difftune.data.images import (IMAGE_EXTENSIONS, fit_pixels, load_pixels, load_rgb,
                                  probe_image)

VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov", ".mkv"})
ClipMode = Literal["head", "chunks", "slide", "uniform", "full"]
# A frame count rule (step, offset): valid counts are step x N + offset (Wan: 4N + 1, its VAE
# compressing 4 frames into one latent frame after the first).
FrameRule = tuple[int, int]


@dataclass(frozen=True)
class VideoInfo:
    """A probed video: its displayed (width, height), frame rate, number of frames, and the
    rotation its metadata asks for (degrees counterclockwise: 0, 90, 180 or 270; the size is
    the upright one, after it)."""

    size: tuple[int, int]
    fps: float
    frames: int
    rotation: int = 0


@dataclass(frozen=True)
class Clip:
    """One clip of a video: `frames` frames from frame `start`, both at the target rate `fps`;
    `source_fps` is the file's own rate (the two differ when the clip is resampled)."""

    start: int
    frames: int
    fps: float
    source_fps: float

    def source_frames(self) -> list[int]:
        """The source frame shown at each of the clip's frames (nearest earlier one)."""
        ratio = self.source_fps / self.fps
        # the small epsilon keeps exact multiples (e.g. 2 x 0.5) from rounding down by one ulp
        return [math.floor((self.start + k) * ratio + 1e-6) for k in range(self.frames)]


def probe_video(path: Path) -> VideoInfo:
    """Open `path`, read its first video stream's size, rate and length, and decode its first
    frame (a real check that it is readable). Raises ValueError with a short reason."""
    import av

    if path.stat().st_size == 0:
        raise ValueError("empty file (0 bytes)")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            if not rate:
                raise ValueError("no frame rate in the file")
            frames = stream.frames or _count_frames(container)
            turn = _turn(next(iter(container.decode(video=0))))
            w, h = stream.codec_context.width, stream.codec_context.height
    except (av.FFmpegError, StopIteration, OSError) as err:
        raise ValueError(f"unreadable video ({err or 'no frame'})") from None
    size = (h, w) if turn in (90, 270) else (w, h)
    return VideoInfo(size=size, fps=float(rate), frames=int(frames), rotation=turn)


# PIL's transpose for each counterclockwise turn (ROTATE_90 turns counterclockwise, as the
# display matrix's angle does).
_TURNS = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180,
          270: Image.Transpose.ROTATE_270}


def _turn(frame: Any) -> int:
    """A decoded frame's display rotation (its display-matrix side data, which phones write
    for portrait videos) as counterclockwise degrees 0, 90, 180 or 270 (nearest)."""
    return round(frame.rotation / 90) % 4 * 90


def upright(frame: Any) -> Image.Image:
    """A decoded PyAV frame as an RGB image as players show it: turned by its display
    rotation (a phone's portrait video is stored landscape with a rotation to show it)."""
    image, turn = frame.to_image(), _turn(frame)
    return image if not turn else image.transpose(_TURNS[turn])


def probe_frames(folder: Path, fps: float) -> VideoInfo:
    """A folder of frames as a video at `fps` (frames carry no rate of their own): its frame
    count and the first frame's size (every frame is probed when its clip is read). Raises
    ValueError with a short reason."""
    frames = frame_files(folder)
    if not frames:
        raise ValueError("a folder of frames with no image in it")
    return VideoInfo(size=probe_image(frames[0]), fps=fps, frames=len(frames))


def frame_files(folder: Path) -> list[Path]:
    """The image files of a folder of frames, in name order (its frames' order)."""
    return sorted((p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS
                   and p.is_file() and not p.name.startswith(".")), key=lambda p: p.name)


def first_frame(path: Path) -> Image.Image:
    """A video's first frame as an RGB image (the web app's thumbnail); ValueError with
    check's reason when it cannot be read."""
    probe_video(path)
    import av

    with av.open(str(path)) as container:
        return upright(next(iter(container.decode(video=0))))


def _count_frames(container: object) -> int:
    """Frames of a stream that does not state its length (webm/mkv): its packets, counted
    without decoding them."""
    container.seek(0)  # type: ignore[attr-defined]
    count = sum(1 for p in container.demux(video=0) if p.size)  # type: ignore[attr-defined]
    container.seek(0)  # type: ignore[attr-defined]
    return count


def round_frames(count: int, rule: FrameRule | None) -> int:
    """`count` rounded down to a valid frame count under `rule` (at least the rule's
    smallest)."""
    if rule is None:
        return count
    step, offset = rule
    return max(offset, (count - offset) // step * step + offset)


def target_frames(info: VideoInfo, fps: float) -> int:
    """How many frames the video has at `fps` (its duration, in frames of the target rate)."""
    return math.floor(info.frames * fps / info.fps + 1e-6)


def plan_clips(total: int, counts: list[int], mode: ClipMode, stride: int, count: int,
               max_frames: int, rule: FrameRule | None) -> list[tuple[int, int]] | str:
    """The (start, frames) of each clip taken from a video of `total` frames (at the target
    rate), or why none is (too short for every frame count).

    "head": one clip from the start; "chunks": consecutive clips; "slide": one every `stride`
    frames; "uniform": `count` clips evenly spaced; each takes the largest of `counts` that
    fits. "full": the whole video up to `max_frames`, rounded down to the rule.
    """
    if mode == "full":
        n = round_frames(min(total, max_frames), rule)
        return [(0, n)] if n <= total else f"too short: {total} frames, fewer than {n}"
    fitting = [n for n in counts if n <= total]
    if not fitting:
        return (f"too short: {total} frames at the target rate, fewer than every frame count "
                f"({', '.join(map(str, sorted(counts)))})")
    n = max(fitting)
    if mode == "head":
        return [(0, n)]
    if mode == "chunks":
        return [(s, n) for s in range(0, total - n + 1, n)]
    if mode == "slide":
        return [(s, n) for s in range(0, total - n + 1, stride)]
    if count == 1 or total == n:
        return [(0, n)]
    starts = sorted({round(i * (total - n) / (count - 1)) for i in range(count)})
    return [(s, n) for s in starts]


def read_clip(path: Path, clip: Clip, bucket: Bucket, box: tuple[int, int, int, int],
              flip: bool) -> torch.Tensor:
    """Decode `clip` of `path` into a (3, F, H, W) float32 tensor in [-1, 1] for `bucket`,
    each frame prepared as `load_pixels` prepares an image (cover resize, crop `box`, mirror).

    Streams: frames are decoded in order and only the clip's are kept (resized at once);
    decoding stops after its last. Raises ValueError when the video ends before the clip does.
    """
    wanted = clip.source_frames()
    if path.is_dir():  # a folder of frames: read only the clip's
        files = frame_files(path)
        if wanted[-1] >= len(files):
            raise ValueError(f"folder of frames {path} has {len(files)} frames, fewer than "
                             f"the clip's {wanted[-1] + 1} (frames removed since the run "
                             "started?)")
        return torch.stack([load_pixels(files[i], bucket, box, flip) for i in wanted], dim=1)
    out = [fit_pixels(image, bucket, box, flip, path) for image in stream_images(path, wanted)]
    if len(out) == len(wanted):
        return torch.stack(out, dim=1)
    raise ValueError(f"video {path} ends before frame {wanted[len(out)]} (it was shortened "
                     "since the run started?)")


def stream_images(path: Path, wanted: list[int]) -> Iterator[Image.Image]:
    """The frames of `path` at the `wanted` indices (ascending, repeats allowed) as RGB images,
    decoded in order and one at a time; decoding stops after the last wanted frame, and a video
    that ends sooner yields fewer."""
    import av

    with av.open(str(path)) as container:
        k = 0
        for index, frame in enumerate(container.decode(video=0)):
            if index < wanted[k]:
                continue
            image = upright(frame)
            while k < len(wanted) and wanted[k] == index:
                yield image
                k += 1
            if k == len(wanted):
                return


def even_frames(total: int, count: int) -> list[int]:
    """`count` frame indices spread evenly over `total` frames (the middle of each of `count`
    equal spans; fewer, without repeats, when the video has fewer frames)."""
    return sorted({min(total - 1, int((i + 0.5) * total / count)) for i in range(count)})


def sample_frames(path: Path, count: int) -> list[Image.Image]:
    """`count` frames spread evenly over a video or a folder of frames, as RGB images (what a
    captioner looks at). Streams: only the sampled frames are kept. Raises ValueError with a
    short reason when the video cannot be read."""
    import av

    info = probe_frames(path, 1.0) if path.is_dir() else probe_video(path)
    wanted = even_frames(max(info.frames, 1), count)
    if path.is_dir():
        files = frame_files(path)
        return [load_rgb(files[i]) for i in wanted]
    try:
        frames = list(stream_images(path, wanted))
    except av.FFmpegError as err:
        raise ValueError(f"unreadable video ({err})") from None
    if not frames:
        raise ValueError("unreadable video (no frame decoded)")
    return frames
