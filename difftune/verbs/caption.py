"""`difftune caption`: write a caption file beside each image and video of a folder or of a
run's datasets, with a local captioning model (caption/)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from difftune.caption.detect import detect
from difftune.caption.run import Captioner, Outcome, WritePolicy, caption_images
from difftune.caption.styles import default_style, instruction
from difftune.caption.vlm import Hardware
from difftune.errors import DataError

if TYPE_CHECKING:
    from difftune.config import RunConfig

log = logging.getLogger("difftune")


@dataclass(frozen=True)
class CaptionJob:
    """What to caption with and how (see `difftune caption --help` for each field)."""

    model: Path
    style: str | None = None
    prompt: str | None = None
    max_tokens: int = 160
    batch_size: int = 4
    hardware: Hardware = Hardware()
    policy: WritePolicy = WritePolicy()
    threshold: float = 0.35
    character_threshold: float = 0.85
    video_frames: int = 4


@dataclass(frozen=True)
class Folder:
    """A folder of images, the caption extension its loader reads, and whether sub-folders
    are part of it."""

    path: Path
    ext: str = ".txt"
    recursive: bool = True


def folders_of(cfg: "RunConfig") -> list[Folder]:
    """Every subset folder of a run's datasets, each with its own caption extension (a folder
    of class images not generated yet is left out: the run makes it, with its captions)."""
    return [Folder(sub.path, sub.caption_ext, sub.recursive)
            for ds in cfg.datasets for sub in ds.subsets
            if not (sub.class_images and not sub.path.exists())]


def ignored_options(job: CaptionJob, kind: str, style: str) -> list[str]:
    """The options `job` sets that a captioner of `kind` does not use."""
    default = CaptionJob(job.model)
    out = ["--prompt"] if job.prompt and style != "prompt" else []
    if kind == "wd14":
        hw = job.hardware
        out += [name for name, set_ in (("--precision", hw.precision != "auto"),
                                        ("--quantize", hw.quantize != "none"),
                                        ("--max-tokens", job.max_tokens != default.max_tokens))
                if set_]
    else:
        out += [name for name, set_ in (
            ("--threshold", job.threshold != default.threshold),
            ("--character-threshold", job.character_threshold != default.character_threshold))
            if set_]
    return out


def load_captioner(job: CaptionJob) -> Captioner:
    """The captioner in `job.model`, loaded for `job.style` (its kind's default when None)."""
    files = detect(job.model)
    style = job.style or default_style(files.kind)
    text = instruction(files.kind, style, job.prompt)
    for option in ignored_options(job, files.kind, style):
        log.warning("%s is ignored: %s", option, "it applies to " + (
            "--style prompt" if option == "--prompt" else "vision-language models"
            if files.kind == "wd14" else "WD14 taggers"))
    if files.kind == "wd14":
        from difftune.caption.tagger import OnnxTagger

        return OnnxTagger(files.weights, job.threshold, job.character_threshold,
                          job.hardware.device)
    from difftune.caption.vlm import VisionLanguageCaptioner

    return VisionLanguageCaptioner(files, job.hardware, text, job.max_tokens)


def files_of(folder: Folder) -> list[Path]:
    """What `folder` holds to caption, by relative path: its images, its videos, and its
    folders of frames (those the dataset loader reads as clips: a caption file beside them),
    whose images are the clip's frames, not images of their own."""
    from difftune.data.clips import frame_folders
    from difftune.data.discover import list_images
    from difftune.data.video import VIDEO_EXTENSIONS

    clips = frame_folders(folder.path, folder.recursive, folder.ext)
    images = [p for p in list_images(folder.path, folder.recursive)
              if not any(p.is_relative_to(c) for c in clips)]
    videos = list_images(folder.path, folder.recursive, VIDEO_EXTENSIONS)
    return sorted(images + videos + clips, key=lambda p: p.relative_to(folder.path).as_posix())


def run_caption(job: CaptionJob, folders: list[Folder], show_progress: bool = True,
                on_caption: Callable[[Path, str], None] | None = None) -> tuple[Outcome, list[str]]:
    """Caption every folder's images and videos; returns the combined outcome and the lines
    to print."""
    for f in folders:
        if not f.path.is_dir():
            raise DataError(f"dataset folder {f.path} does not exist or is not a folder; give "
                            "the folder of images to caption")
    captioner = load_captioner(job)
    total, lines = Outcome(), []
    for f in folders:
        got = caption_images(captioner, files_of(f), f.ext, job.policy, job.batch_size,
                             show_progress, on_caption, job.video_frames)
        total.written += got.written
        total.kept += got.kept
        total.unreadable += got.unreadable
        lines.append(f"{f.path}: {got.written} caption(s) written, {got.kept} already captioned"
                     + (f", {len(got.unreadable)} unreadable file(s) skipped"
                        if got.unreadable else ""))
        if got.stopped:
            total.stopped = True
            lines.append("stopped: every caption written so far is kept; run the same command "
                         "again to caption the rest")
            break
    return total, lines
