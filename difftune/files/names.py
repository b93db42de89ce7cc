"""The names of the files a run writes, and whether the file system can hold them.

Each rule lives here once and is used twice: by the code that writes the file and by the config
check that refuses, when the config loads, a name the run could not write. Without the check a
too-long `save.name` or placeholder fails with ENAMETOOLONG after the whole run has trained, and
two placeholders that share a file name overwrite each other's embedding file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Characters kept in an embedding file's stem: safe in file names on every OS and in every UI.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
SUFFIX = ".safetensors"
# A DoRA run's ComfyUI file beside each LoRA file: `<name>-comfyui.safetensors`,
# `<name>-step000123-comfyui.safetensors` (adapters/dora_comfyui.py).
COMFYUI_DORA = "-comfyui"
# formats.save_lora writes `.<final name>.<8 random characters>.tmp` (tempfile.mkstemp) in the
# same folder and renames it into place: 14 bytes on top of the final name.
TEMP_EXTRA = len("." + "." + "x" * 8 + ".tmp")
# What Linux, macOS and Windows (NTFS) allow for one path component, where pathconf cannot say.
DEFAULT_NAME_MAX = 255


def embedding_stem(placeholder: str) -> str:
    """The file stem of a placeholder's embedding file (`<sks>` -> `sks`): its characters that
    are safe in a file name (A-Z a-z 0-9 _ . -), or "embedding" when none is."""
    return _UNSAFE.sub("", placeholder) or "embedding"


def step_name(stem: str, step: int) -> str:
    """`<stem>-step000123.safetensors`: a file saved before the end of the run (the longest
    name a run writes for `stem` is the one of its last step)."""
    return f"{stem}-step{step:06d}{SUFFIX}"


def name_max(folder: Path) -> int:
    """The longest file name (in bytes) allowed in `folder`, which need not exist yet: asked of
    the file system of its nearest existing ancestor; 255 where the system cannot say."""
    for place in (folder, *folder.parents):
        if place.is_dir():
            try:
                return int(os.pathconf(place, "PC_NAME_MAX"))
            except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or no answer
                return DEFAULT_NAME_MAX
    return DEFAULT_NAME_MAX


def name_too_long(stem: str, steps: int, folder: Path, extra: str = "") -> str | None:
    """Why files named from `stem` cannot be written in `folder` (None when they can): the
    longest one, under its temporary name while it is written, must fit the file system.
    `extra` is a tail some files add before the suffix (COMFYUI_DORA)."""
    tail = step_name("", steps).removesuffix(SUFFIX) + extra + SUFFIX
    size = len((stem + tail).encode()) + TEMP_EXTRA
    limit = name_max(folder)
    if size <= limit:
        return None
    room = limit - (size - len(stem.encode()))
    return (f"file names made from it are too long for the file system of {folder}: "
            f"'<it>{tail}' takes {size - TEMP_EXTRA} bytes, and {size} under its temporary "
            f"name while it is written, over the limit of {limit}; shorten it to at most "
            f"{max(room, 0)} bytes")
