"""Finding the training images and captions, checking them, and assigning buckets.

`build(datasets, bucket_step)` turns the `[[datasets]]` config into a `DataSet`: one `Item` per
usable image and dataset resolution, in a deterministic order (dataset, subset, path, then
resolution as written), plus what was skipped and why. Unusable images are skipped with a warning rather than crashing an hour later; a folder that
does not exist, or a dataset left with no usable image, is a `DataError` now.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from difftune.config import DatasetConfig, SubsetConfig
from difftune.data.captions import WILDCARD, CaptionAugment
from difftune.data.buckets import Bucket, assign_bucket, make_buckets, square_bucket
from difftune.data.images import probe_image, upscale_problem
from difftune.data.masks import check_mask_folder, find_masks
from difftune.data.pairs import check_control_folders, partners
from difftune.errors import DataError

log = logging.getLogger("difftune.data")

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp"})
# A family's control-image size rule: (control's upright size, target bucket, dataset
# resolution) -> the (width, height) the control is encoded at.
ControlSize = Callable[[tuple[int, int], tuple[int, int], int], tuple[int, int]]


@dataclass(frozen=True)
class Item:
    """One usable training image and how it is prepared.

    `size` is the upright (EXIF-rotated) original (width, height); `bucket` the (width, height)
    it is trained at; `dataset`/`subset` index the config lists; `repeats`, `flip`, `crop` and
    the caption augmentations (`augment`) come from its subset; `controls` are its edit
    pair's control/reference images (empty for text-to-image subsets) and `control_sizes` the
    (width, height) each is encoded at, by the family's rule (`Family.control_size`).
    A masked item (`masked`) has its mask file in `mask`, or takes its alpha channel
    (`alpha_mask`); `unmasked_weight` is the loss weight of its black area (data/masks.py).
    `resolution` is the dataset side it is bucketed at (an image of a multi-resolution dataset
    is one item per resolution; 0 for items made outside `build`).
    """

    path: Path
    caption: str
    size: tuple[int, int]
    bucket: tuple[int, int]
    dataset: int
    subset: int
    repeats: int
    flip: bool
    crop: str
    augment: CaptionAugment = CaptionAugment()
    controls: tuple[Path, ...] = ()
    control_sizes: tuple[tuple[int, int], ...] = ()
    resolution: int = 0
    mask: Path | None = None
    alpha_mask: bool = False
    unmasked_weight: float = 1.0
    regularization: bool = False
    loss_weight: float = 1.0

    @property
    def masked(self) -> bool:
        """Whether this item's loss is weighted by a mask."""
        return self.mask is not None or self.alpha_mask


@dataclass
class DataSet:
    """All items of a run, and the files that were left out (for `difftune check`);
    `held` is the validation set (never trained on)."""

    items: list[Item]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)
    held: list[Item] = field(default_factory=list)  # the validation set (data/holdout.py)

    def summary(self) -> dict[str, Any]:
        """Counts for reports: images, skipped, captions missing, per bucket, per subset.

        Buckets are keyed "WxH", subsets by their config name "datasets[i].subsets[j]";
        `samples_per_epoch` counts repeats (regularization samples as many as training
        ones, `balance.py`); `upscaled` counts images smaller than their bucket;
        `pairs` (only for runs with edit pairs) counts the complete pairs. With several
        resolutions, `images` counts each image once while `samples_per_epoch`, `upscaled` and
        `buckets` count its items (one per resolution), and `resolutions` gives each side's items
        (as "images"), upscaled items and buckets.
        """
        buckets = Counter(f"{it.bucket[0]}x{it.bucket[1]}" for it in self.items)
        subsets = Counter(f"datasets[{it.dataset}].subsets[{it.subset}]" for it in self.items)
        upscaled = sum(
            1 for it in self.items if it.size[0] < it.bucket[0] or it.size[1] < it.bucket[1]
        )
        pairs = {"pairs": sum(1 for it in self.items if it.controls)} if any(
            it.controls for it in self.items) else {}
        masked = sum(1 for it in self.items if it.masked)
        return {
            **pairs,
            **({"masked": masked} if masked else {}),
            "images": len({(it.dataset, it.subset, it.path) for it in self.items}),
            "samples_per_epoch": samples_per_epoch(self.items),
            "skipped": len(self.skipped),
            "captions_missing": len(self.missing_captions),
            "upscaled": upscaled,
            "buckets": dict(sorted(buckets.items())),
            "subsets": dict(sorted(subsets.items())),
            **self._per_resolution(),
        }

    def _per_resolution(self) -> dict[str, Any]:
        """{"resolutions": {side: {"images": n, "buckets": {...}}}} when items were bucketed at
        more than one side ({} otherwise, so single-resolution reports stay as they were)."""
        sides = sorted({it.resolution for it in self.items})
        if len(sides) < 2:
            return {}
        out: dict[str, Any] = {}
        for side in sides:
            items = [it for it in self.items if it.resolution == side]
            buckets = Counter(f"{it.bucket[0]}x{it.bucket[1]}" for it in items)
            upscaled = sum(1 for it in items
                           if it.size[0] < it.bucket[0] or it.size[1] < it.bucket[1])
            out[str(side)] = {"images": len(items), "upscaled": upscaled,
                              "buckets": dict(sorted(buckets.items()))}
        return {"resolutions": out}


def samples_per_epoch(items: list[Item]) -> int:
    """Samples in an epoch: each training item `repeats` times, and when regularization
    items exist, as many regularization samples again (the balance rule of `balance.py`)."""
    train = sum(it.repeats for it in items if not it.regularization)
    return 2 * train if any(it.regularization for it in items) else train


def list_images(folder: Path, recursive: bool) -> list[Path]:
    """Image files under `folder` (extension case-insensitive), sorted by relative path.

    Hidden files and folders (name starting with ".", e.g. macOS "._x.jpg" resource forks or
    ".ipynb_checkpoints") are ignored: they are never training data.
    """
    candidates = folder.rglob("*") if recursive else folder.iterdir()
    found = []
    for path in candidates:
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file():
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def read_caption(image: Path, caption_ext: str) -> str | None:
    """The stripped UTF-8 text of `image`'s same-stem caption file, or None when there is none.

    A byte-order mark is tolerated (utf-8-sig). An existing but empty file is an intentional
    empty caption and is returned as "". A file that is not UTF-8 is a `DataError`.
    """
    ext = caption_ext if caption_ext.startswith(".") else f".{caption_ext}"
    path = image.with_suffix(ext)
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as err:
        raise DataError(
            f"caption file {path} is not UTF-8 ({err.reason} at byte {err.start}); "
            "re-save it as UTF-8"
        ) from None


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
    control_size: ControlSize | None = None,
) -> list[Item]:
    """Items of one subset: per image, one per resolution (`buckets` maps each of the dataset's
    resolutions to its candidate buckets, in config order); skipped files and missing captions
    are recorded in `out`. `control_size` sizes each edit pair's control images at the item's
    resolution."""
    where = f"datasets[{d}].subsets[{s}].path"
    if not sub.path.exists():
        raise DataError(f"{where}: folder {sub.path} does not exist; fix the path in the config")
    if not sub.path.is_dir():
        raise DataError(f"{where}: {sub.path} is not a folder; point it at a folder of images")
    check_control_folders(sub, f"datasets[{d}].subsets[{s}]")
    check_mask_folder(sub, f"datasets[{d}].subsets[{s}]")
    paths = list_images(sub.path, sub.recursive)
    augment = CaptionAugment.from_subset(sub)
    items = []
    for path, probed in zip(paths, _probe_all(paths), strict=True):
        controls = partners(path, sub) if sub.control_path else ()
        caption: str | None = None
        for res, candidates in buckets.items():
            placed = _place(probed, candidates)
            if isinstance(probed, str) or isinstance(controls, str):  # the same at every side
                _skip(out, path, probed if isinstance(probed, str) else
                      f"edit pair skipped: {controls}")
                break
            if isinstance(placed, str):  # too far from this side's buckets: skip it there
                _skip(out, path, placed if len(buckets) == 1 else f"at resolution {res}: {placed}")
                continue
            if caption is None:
                caption = _caption(path, sub, out)
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
    if not items:
        log.warning("%s: no usable image in %s", where, sub.path)
    return items


def _with_masks(items: list[Item], sub: SubsetConfig, where: str) -> list[Item]:
    """The subset's items with their masks (a `DataError` names every image without one)."""
    masks = find_masks([it.path for it in items], sub, where)
    return [replace(it, mask=m, alpha_mask=sub.alpha_mask, unmasked_weight=sub.unmasked_weight)
            for it, m in zip(items, masks, strict=True)]


def _skip(out: DataSet, path: Path, why: str) -> None:
    """Record (and warn about) an image, or one resolution of it, left out."""
    log.warning("skipping image %s: %s", path, why)
    out.skipped.append((path, why))


def _caption(path: Path, sub: SubsetConfig, out: DataSet) -> str:
    """The image's caption, or the subset's default (recorded as missing in `out`)."""
    caption = read_caption(path, sub.caption_ext)
    if caption is None:
        log.warning(
            "no caption file for %s; using the default caption %r", path, sub.default_caption
        )
        out.missing_captions.append(path)
        caption = sub.default_caption
    return caption


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
          control_size: ControlSize | None = None) -> DataSet:
    """Discover, check and bucket every image of every dataset.

    `bucket_step` is the model family's default side granularity, used where a dataset leaves
    `bucket_step` unset. Raises `DataError` for a missing folder or a dataset with no usable
    image; everything else (unreadable files, missing captions) is a logged warning and is
    recorded in the result. `control_size` is the family's control-image size rule (see
    `ControlSize`; None: a control takes its target's bucket).
    """
    out = DataSet(items=[])
    for d, ds in enumerate(datasets):
        buckets = {res: dataset_buckets(ds, bucket_step, res) for res in ds.resolutions}
        found = []
        for s, sub in enumerate(ds.subsets):
            found += _subset_items(sub, d, s, buckets, out, control_size)
        if not found and not all(sub.class_images for sub in ds.subsets):
            # (a dataset of class images alone is empty until they are generated)
            folders = ", ".join(str(sub.path) for sub in ds.subsets)
            skipped = [f"{p.name}: {why}" for p, why in out.skipped if _under(p, ds)]
            detail = f" (skipped: {'; '.join(skipped[:5])})" if skipped else ""
            raise DataError(
                f"datasets[{d}] has no usable image in {folders}{detail}; add "
                f"{'/'.join(sorted(e[1:] for e in IMAGE_EXTENSIONS))} images there or fix the path"
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
