"""Uploads into a dataset folder: images and caption files, each checked before it lands.

The rules (each refusal is an `UploadRefused` naming the file and the reason, an HTTP 4xx):
- the name is a plain file name: no folder separator, not hidden (no leading dot), no control
  characters, at most 255 bytes; its extension is an image's the data loader reads
  (`discover.IMAGE_EXTENSIONS`) or a caption's (`datasets.CAPTION_EXTENSIONS`) (422);
- an existing file of that name is never replaced: the upload is refused (409), so the user
  decides (rename it, or delete the old one) and nothing they made is lost;
- an image is at most `MAX_UPLOAD_BYTES` and must decode as training decodes it; a caption
  file is at most `limits.MAX_TEXT_BYTES` and UTF-8 text (413 / 422);
- the folder, and the file it would become, lie under the roots and outside the app's own
  folder (`Roots.resolve(write=True)`, 403).
The bytes are copied in chunks to a hidden temporary file beside the target, checked, then
linked to its name (an atomic create that fails when the name was taken meanwhile).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from difftune.errors import ConfigError
from difftune.ui.datasets import CAPTION_EXTENSIONS
from difftune.ui.limits import MAX_TEXT_BYTES, MAX_UPLOAD_BYTES, decode
from difftune.ui.security import Roots

# An image over limits.MAX_UPLOAD_BYTES (64 MiB: phone photos and 4K PNGs fit) is refused.
CHUNK = 1 << 20


class UploadRefused(ValueError):
    """An uploaded file the app will not write; `status` is the HTTP status to answer."""

    def __init__(self, name: str, reason: str, status: int = 422) -> None:
        super().__init__(f"{name!r}: {reason}")
        self.name, self.reason, self.status = name, reason, status


@dataclass
class Incoming:
    """A file as it arrives: its name as sent and a binary stream of its bytes."""

    name: str
    stream: BinaryIO


def kinds() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The extensions of the images the data loader reads, and of caption files."""
    from difftune.data.discover import IMAGE_EXTENSIONS

    return tuple(sorted(IMAGE_EXTENSIONS)), CAPTION_EXTENSIONS


def allowed_extensions() -> tuple[str, ...]:
    """The extensions an upload may have: the data loader's images, then captions."""
    images, captions = kinds()
    return (*images, *captions)


def check_name(name: str) -> str:
    """`name` if it is a plain, visible file name with an allowed extension; UploadRefused
    (422) saying what is wrong otherwise. The name is never rewritten: what lands on disk is
    what the user sent, or nothing."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise UploadRefused(name, "a file name has no folder part; upload the file itself")
    if name.startswith("."):
        raise UploadRefused(name, "hidden files (a name starting with '.') are not data; "
                                  "rename it")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UploadRefused(name, "the name holds a control character; rename it")
    try:
        if len(os.fsencode(name)) > 255:
            raise UploadRefused(name, "the name is longer than 255 bytes; shorten it")
    except UnicodeEncodeError:
        raise UploadRefused(name, "the name is not valid text; rename it") from None
    if Path(name).suffix.lower() not in allowed_extensions():
        raise UploadRefused(name, f"not an image or caption file; the extension must be one of "
                                  f"{', '.join(allowed_extensions())}")
    return name


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    """The stream's bytes, `CHUNK` at a time."""
    while chunk := stream.read(CHUNK):
        yield chunk


def _limit(name: str) -> int:
    """The largest file of this name's kind."""
    return MAX_TEXT_BYTES if Path(name).suffix.lower() in CAPTION_EXTENSIONS else MAX_UPLOAD_BYTES


def _copy(incoming: Incoming, tmp: Path) -> None:
    """Copy the upload to `tmp` in chunks; UploadRefused (413) once it passes its limit."""
    limit, size = _limit(incoming.name), 0
    with tmp.open("wb") as out:
        for chunk in _chunks(incoming.stream):
            size += len(chunk)
            if size > limit:
                raise UploadRefused(incoming.name, f"larger than {limit >> 20} MiB, the most "
                                                   "the app takes for a file of its kind", 413)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())


def _verify(name: str, tmp: Path) -> None:
    """UploadRefused (422) when the copy is not what training reads: an image that does not
    decode, a caption that is not UTF-8."""
    from difftune.data.images import probe_image

    if Path(name).suffix.lower() in CAPTION_EXTENSIONS:
        try:
            decode(tmp.read_bytes(), name, "caption file")
        except ConfigError as err:
            raise UploadRefused(name, str(err)) from None
        return
    try:
        probe_image(tmp)
    except ValueError as err:
        raise UploadRefused(name, f"not a readable image ({err})") from None


def save_one(roots: Roots, folder: Path, incoming: Incoming) -> Path:
    """Write one upload into `folder` (already resolved under the roots) and return its
    path; UploadRefused (or PathOutsideRoots) when it may not land there."""
    name = check_name(incoming.name)
    if os.path.lexists(folder / name):
        raise UploadRefused(name, f"{folder / name} exists; the app never replaces a file: "
                                  "rename the upload or delete the old file first", 409)
    target = roots.resolve(folder / name, write=True)
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".upload")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _copy(incoming, tmp)
        _verify(name, tmp)
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, target)  # fails when the name was taken since the check above
        except FileExistsError:
            raise UploadRefused(name, f"{target} exists; the app never replaces a file", 409) \
                from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def save_all(roots: Roots, folder: str | Path, files: Iterable[Incoming]
             ) -> tuple[list[Path], list[UploadRefused]]:
    """Each upload written into `folder` (a folder under the roots, PathOutsideRoots or
    ValueError otherwise): the paths written and the refusals, one per refused file."""
    where = roots.resolve(folder, write=True)
    if not where.is_dir():
        raise ValueError(f"{folder} is not a folder; upload into an existing dataset folder")
    saved: list[Path] = []
    refused: list[UploadRefused] = []
    for incoming in files:
        try:
            saved.append(save_one(roots, where, incoming))
        except UploadRefused as err:
            refused.append(err)
    return saved, refused
