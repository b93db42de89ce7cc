"""Videos among a dataset's images in the web app: which files are data (images and videos),
and a video's facts for the browse page (size, frame count, rate), read as training reads
them (`difftune.data.video`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def media() -> frozenset[str]:
    """The extensions of the files training reads as data: images and videos."""
    from difftune.data.discover import IMAGE_EXTENSIONS
    from difftune.data.video import VIDEO_EXTENSIONS

    return IMAGE_EXTENSIONS | VIDEO_EXTENSIONS


def is_video(path: Path) -> bool:
    """Whether `path` names a video file (by its extension, as training finds them)."""
    from difftune.data.video import VIDEO_EXTENSIONS

    return path.suffix.lower() in VIDEO_EXTENSIONS


def video_facts(entry: Any, video: Path) -> None:
    """A video entry's size, frame count and rate (or why it is unreadable: check's words)."""
    from difftune.data.video import probe_video

    try:
        info = probe_video(video)
    except ValueError as err:
        entry.error = str(err)
        return
    (entry.width, entry.height), entry.frames, entry.fps = info.size, info.frames, info.fps
