"""The items of a run: `Item` (one image, or one clip of a video, and how it is prepared) and
`DataSet` (all items, what was left out and why, and the counts `check` reports); reading an
item's caption and recording what was skipped, which image and video discovery share."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftune.config import SubsetConfig
from difftune.data.captions import CaptionAugment
from difftune.data.video import Clip
from difftune.errors import DataError

log = logging.getLogger("difftune.data")


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
    clip: Clip | None = None  # a video's clip (its frames, start and rate); None: an image

    @property
    def bucket_name(self) -> str:
        """The bucket as reports name it: "WxH" for an image, "WxHxF" for a clip of F frames."""
        w, h = self.bucket
        return f"{w}x{h}" if self.clip is None else f"{w}x{h}x{self.clip.frames}"

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
    # What `check` reports besides skips: resampled video sources, rounded frame counts.
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts for reports: images, skipped, captions missing, per bucket, per subset.

        Buckets are keyed "WxH" ("WxHxF" for clips of F frames; `clips` counts them when
        there are some), subsets by their config name "datasets[i].subsets[j]";
        `samples_per_epoch` counts repeats (regularization samples as many as training
        ones, `balance.py`); `upscaled` counts images smaller than their bucket;
        `pairs` (only for runs with edit pairs) counts the complete pairs. With several
        resolutions, `images` counts each image once while `samples_per_epoch`, `upscaled` and
        `buckets` count its items (one per resolution), and `resolutions` gives each side's items
        (as "images"), upscaled items and buckets.
        """
        buckets = Counter(it.bucket_name for it in self.items)
        subsets = Counter(f"datasets[{it.dataset}].subsets[{it.subset}]" for it in self.items)
        upscaled = sum(
            1 for it in self.items if it.size[0] < it.bucket[0] or it.size[1] < it.bucket[1]
        )
        pairs = {"pairs": sum(1 for it in self.items if it.controls)} if any(
            it.controls for it in self.items) else {}
        masked = sum(1 for it in self.items if it.masked)
        clips = sum(1 for it in self.items if it.clip is not None)
        return {
            **pairs,
            **({"clips": clips, "videos": len({it.path for it in self.items if it.clip})}
               if clips else {}),
            **({"masked": masked} if masked else {}),
            "images": len({(it.dataset, it.subset, it.path) for it in self.items
                           if it.clip is None}),
            "samples_per_epoch": samples_per_epoch(self.items),
            "skipped": len(self.skipped),
            "captions_missing": len(self.missing_captions),
            "upscaled": upscaled,
            "buckets": dict(sorted(buckets.items())),
            "subsets": dict(sorted(subsets.items())),
            **self._per_resolution(),
        }

    def _per_resolution(self) -> dict[str, Any]:
        """{"resolutions": {side: {"images": n, "buckets": {...}}}} ("clips": their clips too,
        when there are any) when items were bucketed at
        more than one side ({} otherwise, so single-resolution reports stay as they were)."""
        sides = sorted({it.resolution for it in self.items})
        if len(sides) < 2:
            return {}
        out: dict[str, Any] = {}
        for side in sides:
            items = [it for it in self.items if it.resolution == side]
            buckets = Counter(it.bucket_name for it in items)
            upscaled = sum(1 for it in items
                           if it.size[0] < it.bucket[0] or it.size[1] < it.bucket[1])
            clips = sum(1 for it in items if it.clip is not None)
            out[str(side)] = {"images": len(items) - clips, "upscaled": upscaled,
                              **({"clips": clips} if clips else {}),
                              "buckets": dict(sorted(buckets.items()))}
        return {"resolutions": out}


def samples_per_epoch(items: list[Item]) -> int:
    """Samples in an epoch: each training item `repeats` times, and when regularization
    items exist, as many regularization samples again (the balance rule of `balance.py`)."""
    train = sum(it.repeats for it in items if not it.regularization)
    return 2 * train if any(it.regularization for it in items) else train


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


def skip(out: DataSet, path: Path, why: str, what: str = "image") -> None:
    """Record (and warn about) an image (a video: `what`), or one resolution of it, left
    out."""
    log.warning("skipping %s %s: %s", what, path, why)
    out.skipped.append((path, why))


def caption_of(path: Path, sub: SubsetConfig, out: DataSet) -> str:
    """The image's caption, or the subset's default (recorded as missing in `out`)."""
    caption = read_caption(path, sub.caption_ext)
    if caption is None:
        log.warning(
            "no caption file for %s; using the default caption %r", path, sub.default_caption
        )
        out.missing_captions.append(path)
        caption = sub.default_caption
    return caption
