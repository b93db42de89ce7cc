"""Edit training pairs: each target image matched to its control/reference images by path.

A subset with `control_path` names one or more folders of control images. A target's partner in
each folder is the image with the same path relative to its subset folder, extension aside
(`data/after/red/cat.png` pairs with `data/before/red/cat.jpg`). A pair whose partner is missing,
ambiguous or unreadable is skipped with a warning naming the file; a subset where no pair is
complete is a `DataError`, as is a control folder that does not exist or lies inside a
recursively searched target folder (its images would be trained on as targets).
"""

from __future__ import annotations

import glob
from pathlib import Path

from difftune.config import SubsetConfig
from difftune.data.images import probe_image
from difftune.errors import DataError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp"})


def check_control_folders(sub: SubsetConfig, where: str) -> None:
    """Refuse control folders that are missing, not folders, or inside the searched target
    folder. `where` names the subset in messages (`datasets[0].subsets[1]`)."""
    for i, folder in enumerate(sub.control_path):
        field = f"{where}.control_path[{i}]"
        if not folder.is_dir():
            what = "does not exist" if not folder.exists() else "is not a folder"
            raise DataError(f"{field}: {folder} {what}; point it at the folder of control images")
        if sub.recursive and folder.resolve().is_relative_to(sub.path.resolve()):
            raise DataError(
                f"{field}: {folder} lies inside the target folder {sub.path}, which is searched "
                "recursively, so its control images would be trained on as targets; move it "
                f"beside the target folder or set {where}.recursive = false")


def _partner(image: Path, root: Path, folder: Path, what: str = "control image"
             ) -> Path | str:
    """`image`'s partner in `folder` (same relative path, any image extension), or why none;
    `what` names the partner in the reason ("control image", "mask")."""
    rel = image.relative_to(root).with_suffix("")
    pattern = glob.escape(str(folder / rel)) + ".*"
    found = sorted(p for p in map(Path, glob.glob(pattern))
                   if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not found:
        return f"no {what} {rel.as_posix()}.* in {folder}"
    if len(found) > 1:
        return f"several {what}s match it in {folder}: {[p.name for p in found]}; keep one"
    return found[0]


def partners(image: Path, sub: SubsetConfig) -> tuple[Path, ...] | str:
    """The control images of target `image` in the order of `sub.control_path`, or the reason
    the pair is skipped (a partner missing, ambiguous or unreadable)."""
    out = []
    for folder in sub.control_path:
        found = _partner(image, sub.path, folder)
        if isinstance(found, str):
            return found
        try:
            probe_image(found)
        except (ValueError, OSError) as err:
            return f"its control image {found} is unreadable: {err}"
        out.append(found)
    return tuple(out)
