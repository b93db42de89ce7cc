"""Cache keys: a hash of everything that decides an entry's value.

A key covers the family, the weights' fingerprint, the dtype, the preprocessing parameters and
the content itself (image bytes, exact caption text). Editing an image or a caption, changing the
bucket, crop, flip, max length or the model gives a new key by construction, so a stale entry
can never be read; no step number or dataloader position is ever part of a key.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any


def entry_key(fields: dict[str, Any]) -> str:
    """The key of an entry: sha256 of the canonical JSON of its input fields (sorted keys)."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=65536)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file's bytes; memoized on (path, size, mtime) so each file is read once."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hash(path: Path) -> str:
    """Content hash of a file (re-read when its size or mtime changes)."""
    st = path.stat()
    return _file_hash(str(path), st.st_size, st.st_mtime_ns)


def content_hash(path: Path) -> str:
    """A file's content hash; for a folder of frames (a clip), the hash of its image files'
    names and hashes in order (a frame added, removed or edited changes it)."""
    if not path.is_dir():
        return file_hash(path)
    from difftune.data.video import frame_files

    h = hashlib.sha256()
    for frame in frame_files(path):
        h.update(f"{frame.name}:{file_hash(frame)}\n".encode())
    return h.hexdigest()


def latent_fields(
    family: str, fingerprint: str, dtype: str, image: Path,
    bucket: tuple[int, int], box: tuple[int, int, int, int], flip: bool,
    mask: Path | None = None, alpha_mask: bool = False, clip: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The inputs that decide a latent entry (also stored as the entry's metadata). A masked
    item's entry holds its mask too: the mask file's content (or the alpha-mask flag, the
    image's content being there already) is part of its key; unmasked keys stay as they were.
    A video clip's entry adds its start frame, frame count and frame rate (`clip`) to the
    file's hash, size and model; an image's key has no such field and is unchanged."""
    fields = {
        "kind": "latent", "family": family, "model": fingerprint, "dtype": dtype,
        "image_sha256": content_hash(image), "bucket": list(bucket), "box": list(box),
        "flip": flip,
    }
    if mask is not None:
        fields["mask_sha256"] = content_hash(mask)
    if alpha_mask:
        fields["alpha_mask"] = True
    if clip is not None:
        fields["clip"] = clip
    return fields


def text_fields(
    family: str, fingerprint: str, dtype: str, caption: str, encoders: list[dict[str, Any]],
    images: list[str] | None = None,
) -> dict[str, Any]:
    """The inputs that decide a text entry: exact caption and each encoder's declared settings,
    and the content keys of the images an encoder reads with the caption (only when it reads
    some: the keys of text-only entries stay as they were)."""
    fields: dict[str, Any] = {"kind": "text", "family": family, "model": fingerprint,
                              "dtype": dtype, "caption": caption, "encoders": encoders}
    if images:
        fields["images"] = images
    return fields


def control_fields(family: str, fingerprint: str, dtype: str, image: Path,
                   size: tuple[int, int], rule: str) -> dict[str, Any]:
    """The inputs that decide a control-image latent: its content, the size it is encoded at
    and the family's size rule (`rule`; resized whole, never cropped or flipped)."""
    return {"kind": "control", "family": family, "model": fingerprint, "dtype": dtype,
            "image_sha256": file_hash(image), "size": list(size), "rule": rule}
