"""Images a vision-language text encoder reads together with a caption, as cache-key parts.

An edit family's text encoder may read the pair's control image(s) with the instruction, so its
output depends on the image: each such image is a `TextImage`, whose `key` names its content
and the size it is read at (file bytes, size and the family's size rule; or, for an image given
in memory, its pixels), so editing the image or the rule gives a new text entry by
construction. The image itself is decoded only when an entry must be computed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftune.cache.keys import file_hash


@dataclass(frozen=True)
class TextImage:
    """One image read with a caption: its content key and how to decode it (a file resized to
    `size`, or a PIL image kept as it is)."""

    key: str
    path: Path | None = None
    size: tuple[int, int] | None = None
    image: Any = field(default=None, compare=False, hash=False)

    def load(self) -> Any:
        """The upright RGB PIL image, at `size` where one is given (LANCZOS, as the edit
        pipelines' image processor resizes)."""
        from PIL import Image

        from difftune.data.images import load_rgb

        img = self.image
        if img is None:
            img = load_rgb(self.path)  # type: ignore[arg-type]
        if self.size is not None and img.size != tuple(self.size):
            img = img.resize(tuple(self.size), Image.Resampling.LANCZOS)
        return img


def from_file(path: Path, size: tuple[int, int], rule: str) -> TextImage:
    """A dataset's control image, read at `size` (given by the family's rule `rule`)."""
    return TextImage(f"file:{file_hash(path)}:{size[0]}x{size[1]}:{rule}", path, tuple(size))


def from_pil(image: Any) -> TextImage:
    """An image in memory (a sample's input, already sized as the pipeline sizes it)."""
    digest = hashlib.sha256(image.tobytes()).hexdigest()
    return TextImage(f"pixels:{image.mode}:{image.size[0]}x{image.size[1]}:{digest}",
                     image=image)
