"""What the app opens or lists under a folder, seen through Python's audit events ("open",
"os.listdir", "os.scandir": every file Python opens and every folder it lists, in any thread),
so a test can show a file outside the roots was never read, not only that the answer said no."""

from __future__ import annotations

import json
import os
import struct
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

EVENTS = ("open", "os.listdir", "os.scandir")
_watched: list[tuple[str, list[str]]] = []  # (folder, paths seen under it) while watched
_installed: list[bool] = []


def _hook(event: str, args: tuple[Any, ...]) -> None:
    """Record an opened or listed path under a watched folder (an audit hook: never raises)."""
    if not _watched or event not in EVENTS or not args:
        return
    try:
        path = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else None
    except (TypeError, ValueError):
        return
    for folder, seen in list(_watched):
        if path is not None and (path == folder or path.startswith(folder + os.sep)):
            seen.append(path)


@contextmanager
def opened_under(folder: Path) -> Iterator[list[str]]:
    """The paths under `folder` opened or listed while the block runs (an audit hook stays
    in the process once added; it does nothing while no block watches)."""
    if not _installed:
        sys.addaudithook(_hook)
        _installed.append(True)
    entry: tuple[str, list[str]] = (str(folder.resolve()), [])
    _watched.append(entry)
    try:
        yield entry[1]
    finally:
        _watched.remove(entry)


def flux_safetensors(path: Path) -> Path:
    """A safetensors file whose one tensor name is a FLUX.1 denoiser's: reading its header
    names the family, which no refusal of a file outside the roots may show."""
    header = json.dumps({"double_blocks.0.img_attn.qkv.weight":
                         {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return path
