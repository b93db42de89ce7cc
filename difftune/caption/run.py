"""Walking a dataset's images and videos and writing their caption files.

Each caption is written (atomically, files/atomic.py) as soon as its batch is done, so a stop
at any moment keeps every caption written, and a rerun skips the images that have one. An
existing caption is never replaced unless asked (`overwrite`), or is kept and added to
(`append`); an image that cannot be decoded is skipped with a warning naming it. The next
batch's images are decoded in threads while the model captions the current one. A video (or a
folder of frames) is captioned from a few frames sampled evenly over it (`data.video`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

from PIL import Image
from tqdm import tqdm

from difftune.caption.styles import appended, clean, with_prefix
from difftune.data.images import load_rgb
from difftune.data.video import VIDEO_EXTENSIONS, sample_frames
from difftune.files.atomic import write_atomically

log = logging.getLogger("difftune")


class Captioner(Protocol):
    """Anything that captions a batch of images (a vision-language model, a tagger)."""

    def caption(self, images: list[Image.Image]) -> list[str]:
        """One raw answer per image."""

    def caption_frames(self, clips: list[list[Image.Image]]) -> list[str]:
        """One raw answer per clip (a video's sampled frames)."""


@dataclass(frozen=True)
class WritePolicy:
    """How captions are written: `mode` "skip" (an image with a non-empty caption file is left
    alone), "overwrite" or "append"; `prefix` and `trigger` go before each new caption."""

    mode: str = "skip"
    prefix: str = ""
    trigger: str = ""


@dataclass
class Outcome:
    """What a captioning pass did: captions `written`, images `kept` (already captioned),
    `unreadable` images with the reason, whether it was `stopped` (Ctrl-C) before the end."""

    written: int = 0
    kept: int = 0
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    stopped: bool = False


def caption_path(image: Path, ext: str) -> Path:
    """The caption file the dataset loader reads for `image` (same stem, `ext`)."""
    return image.with_suffix(ext if ext.startswith(".") else f".{ext}")


def _existing(path: Path) -> str:
    """The caption file's stripped text ("" when absent or unreadable as UTF-8)."""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def pending(images: list[Path], ext: str, mode: str) -> list[Path]:
    """The images to caption: all of them to overwrite or append, else those whose caption
    file is missing or empty."""
    if mode != "skip":
        return list(images)
    return [im for im in images if not _existing(caption_path(im, ext))]


def is_video(path: Path) -> bool:
    """Whether `path` is captioned as a video: a video file or a folder of frames."""
    return path.is_dir() or path.suffix.lower() in VIDEO_EXTENSIONS


Loaded = Image.Image | list[Image.Image] | str  # an image, a video's frames, or why neither


def _load(path: Path, frames: int) -> Loaded:
    """The decoded image, `frames` frames sampled from a video, or why it could not be read."""
    try:
        return sample_frames(path, frames) if is_video(path) else load_rgb(path)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        return f"{type(err).__name__}: {err}"


def _batches(paths: list[Path], size: int, frames: int) -> Iterator[list[tuple[Path, Loaded]]]:
    """Batches of (path, image or a video's frames or reason); the next batch decodes while
    this one is used."""
    chunks = [paths[i:i + size] for i in range(0, len(paths), size)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        ahead: list[Future] = [pool.submit(_load, p, frames) for p in chunks[0]] if chunks else []
        for n, chunk in enumerate(chunks):
            current = ahead
            nxt = chunks[n + 1] if n + 1 < len(chunks) else []
            ahead = [pool.submit(_load, p, frames) for p in nxt]
            yield list(zip(chunk, (f.result() for f in current), strict=True))


def _write(image: Path, ext: str, answer: str, policy: WritePolicy) -> str | None:
    """Write `image`'s caption from the model's answer, as the policy says; returns it (None,
    with a warning, for an empty answer: no caption file is better than an empty one)."""
    path = caption_path(image, ext)
    text = clean(answer)
    if not text:
        log.warning("the captioner gave no caption for %s (answer %r); it is left as it was",
                    image, answer[:80])
        return None
    old = _existing(path) if policy.mode == "append" else ""
    text = appended(old, text) if old else with_prefix(text, policy.prefix, policy.trigger)
    write_atomically(path, (text + "\n").encode("utf-8"))
    return text


def _answers(captioner: Captioner, good: list[tuple[Path, Loaded]]) -> list[str]:
    """The captioner's raw answer for each (path, image or frames), in order: the images
    captioned together, the videos' frames together."""
    out = [""] * len(good)
    for wanted, run in ((lambda x: not isinstance(x, list), captioner.caption),
                        (lambda x: isinstance(x, list), captioner.caption_frames)):
        at = [i for i, (_, x) in enumerate(good) if wanted(x)]
        for i, answer in zip(at, run([good[i][1] for i in at]) if at else [], strict=True):
            out[i] = answer
    return out


def caption_images(captioner: Captioner, images: list[Path], ext: str, policy: WritePolicy,
                   batch_size: int, show_progress: bool = True,
                   on_caption: Callable[[Path, str], None] | None = None,
                   video_frames: int = 4) -> Outcome:
    """Caption the `images` (and videos, each from `video_frames` frames) that need it (see
    `pending`), `batch_size` at a time, with a progress bar (files/s, ETA). Ctrl-C ends the
    pass after the captions written so far."""
    todo = pending(images, ext, policy.mode)
    out = Outcome(kept=len(images) - len(todo))
    videos = sum(map(is_video, todo))
    log.info("captioning %d file(s) (%d already captioned): %d image(s), %d video(s)",
             len(todo), out.kept, len(todo) - videos, videos)
    bar = tqdm(total=len(todo), desc="caption", unit="file", dynamic_ncols=True,
               disable=not show_progress)
    try:
        for batch in _batches(todo, batch_size, video_frames):
            good = [(p, im) for p, im in batch if not isinstance(im, str)]
            for p, why in ((p, im) for p, im in batch if isinstance(im, str)):
                log.warning("skipping unreadable %s %s: %s",
                            "video" if is_video(p) else "image", p, why)
                out.unreadable.append((p, why))
            for (path, _), answer in zip(good, _answers(captioner, good), strict=True):
                text = _write(path, ext, answer, policy)
                if text is None:
                    continue
                out.written += 1
                if on_caption is not None:
                    on_caption(path, text)
            bar.update(len(batch))
    except KeyboardInterrupt:
        out.stopped = True
    finally:
        bar.close()
    return out
