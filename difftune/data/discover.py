"""Finding the training images and captions, checking them, and assigning buckets.

`build(datasets, bucket_step)` turns the `[[datasets]]` config into a `DataSet`: one `Item` per
usable image and dataset resolution, in a deterministic order (dataset, subset, path, then
resolution as written), plus what was skipped and why. Unusable images are skipped with a warning rather than crashing an hour later; a folder that
does not exist, or a dataset left with no usable image, is a `DataError` now.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

from difftune.config import DatasetConfig, SubsetConfig
from difftune.data.captions import WILDCARD, CaptionAugment
from difftune.data.clips import ClipRule, clip_items, frame_folders
from difftune.data.buckets import Bucket, assign_bucket, make_buckets, square_bucket
from difftune.data.images import IMAGE_EXTENSIONS, probe_image, upscale_problem
from difftune.data.masks import check_mask_folder, find_masks
# (Item, DataSet, read_caption and samples_per_epoch are imported from here too.)
from difftune.data.items import (DataSet, Item, caption_of, read_caption,  # noqa: F401
                                  samples_per_epoch, skip)
from difftune.data.pairs import check_control_folders, partners
from difftune.data.video import VIDEO_EXTENSIONS
from difftune.errors import DataError

log = logging.getLogger("difftune.data")

# A family's control-image size rule: (control's upright size, target bucket, dataset
# resolution) -> the (width, height) the control is encoded at.
ControlSize = Callable[[tuple[int, int], tuple[int, int], int], tuple[int, int]]


def list_images(folder: Path, recursive: bool,
                extensions: frozenset[str] = IMAGE_EXTENSIONS) -> list[Path]:
    """Image files (or files of other `extensions`: videos) under `folder` (extension
    case-insensitive), sorted by relative path.

    Hidden files and folders (name starting with ".", e.g. macOS "._x.jpg" resource forks or
    ".ipynb_checkpoints") are ignored: they are never training data.
    """
    candidates = folder.rglob("*") if recursive else folder.iterdir()
    found = []
    for path in candidates:
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() in extensions and path.is_file():
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _probe_all(paths: list[Path]) -> list[tuple[int, int] | str]:
    """Probe images in parallel (decoding releases the GIL); a size, or the reason it failed."""

    def one(path: Path) -> tuple[int, int] | str:
        try:
            return probe_image(path)
        except (ValueError, OSError) as err:
            return str(err)

    if len(paths) < 8:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(one, paths))


def _place(probed: tuple[int, int] | str, buckets: list[Bucket]
           ) -> tuple[tuple[int, int], Bucket] | str:
    """A probed image's (size, bucket), or why it is skipped (unreadable, or so far from every
    bucket's shape that covering its bucket would make it enormous)."""
    if isinstance(probed, str):
        return probed
    bucket = assign_bucket(probed, buckets)
    return upscale_problem(probed, bucket) or (probed, bucket)


def _control_sizes(controls: tuple[Path, ...], bucket: Bucket, resolution: int,
                   rule: ControlSize | None) -> tuple[tuple[int, int], ...]:
    """The size each control image is encoded at (the target's bucket without a rule)."""
    if rule is None:
        return tuple((bucket[0], bucket[1]) for _ in controls)
    return tuple(rule(probe_image(p), bucket, resolution) for p in controls)


def _subset_items(
    sub: SubsetConfig, d: int, s: int, buckets: dict[int, list[Bucket]], out: DataSet,
    control_size: ControlSize | None = None, clip_folders: list[Path] | None = None,
) -> list[Item]:
    """Items of one subset: per image, one per resolution (`buckets` maps each of the dataset's
    resolutions to its candidate buckets, in config order); skipped files and missing captions
    are recorded in `out`; images inside `clip_folders` (folders of frames) are left to the
    clips. `control_size` sizes each edit pair's control images at the item's
    resolution."""
    where = f"datasets[{d}].subsets[{s}].path"
    if not sub.path.exists():
        raise DataError(f"{where}: folder {sub.path} does not exist; fix the path in the config")
    if not sub.path.is_dir():
        raise DataError(f"{where}: {sub.path} is not a folder; point it at a folder of images")
    check_control_folders(sub, f"datasets[{d}].subsets[{s}]")
    check_mask_folder(sub, f"datasets[{d}].subsets[{s}]")
    paths = [p for p in list_images(sub.path, sub.recursive)
             if not any(p.is_relative_to(f) for f in clip_folders or ())]
    augment = CaptionAugment.from_subset(sub)
    items = []
    for path, probed in zip(paths, _probe_all(paths), strict=True):
        controls = partners(path, sub) if sub.control_path else ()
        caption: str | None = None
        for res, candidates in buckets.items():
            placed = _place(probed, candidates)
            if isinstance(probed, str) or isinstance(controls, str):  # the same at every side
                skip(out, path, probed if isinstance(probed, str) else
                      f"edit pair skipped: {controls}")
                break
            if isinstance(placed, str):  # too far from this side's buckets: skip it there
                skip(out, path, placed if len(buckets) == 1 else f"at resolution {res}: {placed}")
                continue
            if caption is None:
                caption = caption_of(path, sub, out)
            size, bucket = placed
            items.append(Item(
                path=path, caption=caption, size=size, bucket=bucket, dataset=d, subset=s,
                repeats=sub.repeats, flip=sub.flip, crop=sub.crop, augment=augment,
                controls=controls, resolution=res, regularization=sub.regularization,
                loss_weight=sub.loss_weight,
                control_sizes=_control_sizes(controls, bucket, res, control_size),
            ))
    if sub.masked():
        items = _with_masks(items, sub, f"datasets[{d}].subsets[{s}]")
    if not sub.wildcards and any(WILDCARD.search(it.caption) for it in items):
        log.warning("%s: captions hold {a|b} choices but wildcards is off, so they are trained "
                    "as written; set datasets[%d].subsets[%d].wildcards = true to resolve them",
                    where, d, s)
    if not items and sub.control_path:
        raise DataError(f"{where}: no complete edit pair in {sub.path} with "
                        f"{', '.join(map(str, sub.control_path))}; each target image needs a "
                        "control image of the same name in every control folder")
    return items


def _with_masks(items: list[Item], sub: SubsetConfig, where: str) -> list[Item]:
    """The subset's items with their masks (a `DataError` names every image without one)."""
    masks = find_masks([it.path for it in items], sub, where)
    return [replace(it, mask=m, alpha_mask=sub.alpha_mask, unmasked_weight=sub.unmasked_weight)
            for it, m in zip(items, masks, strict=True)]


def dataset_buckets(ds: DatasetConfig, bucket_step: int, resolution: int | None = None
                    ) -> list[Bucket]:
    """The candidate buckets of one dataset at `resolution` (default: its first), one square
    bucket when bucketing is off."""
    step = ds.bucket_step or bucket_step
    res = ds.resolutions[0] if resolution is None else resolution
    if not ds.buckets:
        return [square_bucket(res, step)]
    return make_buckets(res, ds.min_side, ds.max_side, step)


def build(datasets: list[DatasetConfig], bucket_step: int,
          control_size: ControlSize | None = None, clips: ClipRule | None = None) -> DataSet:
    """Discover, check and bucket every image of every dataset.

    `bucket_step` is the model family's default side granularity, used where a dataset leaves
    `bucket_step` unset. Raises `DataError` for a missing folder or a dataset with no usable
    image; everything else (unreadable files, missing captions) is a logged warning and is
    recorded in the result. `control_size` is the family's control-image size rule (see
    `ControlSize`; None: a control takes its target's bucket). `clips` is the family's
    video rule (`data.clips`; None: video files are skipped, the family trains images only).
    """
    out = DataSet(items=[])
    for d, ds in enumerate(datasets):
        buckets = {res: dataset_buckets(ds, bucket_step, res) for res in ds.resolutions}
        found = []
        for s, sub in enumerate(ds.subsets):
            # Folders of frames are clips only for a family that trains clips (an image
            # family reads their images as images, as it always did).
            folders = frame_folders(sub.path, sub.recursive, sub.caption_ext) if (
                clips and sub.path.is_dir()) else []
            made = _subset_items(sub, d, s, buckets, out, control_size, folders)
            videos = list_images(sub.path, sub.recursive, VIDEO_EXTENSIONS) + folders
            clipped = clip_items(videos, sub, ds, (d, s), buckets, clips, out)
            if not made and not clipped:
                log.warning("datasets[%d].subsets[%d].path: no usable image or video in %s",
                            d, s, sub.path)
            found += made + clipped
        if not found and not all(sub.class_images for sub in ds.subsets):
            # (a dataset of class images alone is empty until they are generated)
            folders = ", ".join(str(sub.path) for sub in ds.subsets)
            skipped = [f"{p.name}: {why}" for p, why in out.skipped if _under(p, ds)]
            detail = f" (skipped: {'; '.join(skipped[:5])})" if skipped else ""
            raise DataError(
                f"datasets[{d}] has no usable image in {folders}{detail}; add "
                f"{'/'.join(sorted(e[1:] for e in IMAGE_EXTENSIONS))} images "
                f"({'/'.join(sorted(e[1:] for e in VIDEO_EXTENSIONS))} videos) there or fix the "
                "path"
            )
        out.items += found
    if out.items and all(it.regularization for it in out.items):
        raise DataError("every subset is a regularization subset (regularization = true): "
                        "add a subset of training images, which the regularization images "
                        "are balanced against")
    return out


def _under(path: Path, ds: DatasetConfig) -> bool:
    """Whether `path` lies inside one of the dataset's subset folders."""
    return any(path.is_relative_to(sub.path) for sub in ds.subsets)
