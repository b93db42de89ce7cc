"""Which images are held out of training for the validation loss, and the validation set.

The choice is a stable hash of each image's path (relative to its subset's folder) and
`validation.seed`, never the run's RNG: the same images are held out on every run and resume
of a config, whatever its training seed. `holdable` is the one place that says which items may
be held out (ordinary text-to-image images; not edit pairs, nor any subset with a role of its
own such as regularization images).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from typing import Callable

from difftune.config import RunConfig, SubsetConfig
from difftune.config.validation import AUTO_MIN_IMAGES
from difftune.data.discover import ControlSize, DataSet, Item, build

log = logging.getLogger("difftune.data")


def holdable(item: Item) -> bool:
    """Whether `item` may be held out: an ordinary image (no edit-pair controls, no special
    subset role such as `regularization`)."""
    return not item.controls and not getattr(item, "regularization", False)


def enabled(cfg: RunConfig, images: int) -> bool:
    """Whether validation runs: as configured, or with "auto" when `validation.path` is set
    or the training datasets hold at least AUTO_MIN_IMAGES images (`images`)."""
    v = cfg.validation
    if v.enabled != "auto":
        return bool(v.enabled)
    return v.path is not None or images >= AUTO_MIN_IMAGES


def rule(cfg: RunConfig, images: int) -> str:
    """The sentence `check` prints on why validation is on or off."""
    v = cfg.validation
    if v.enabled != "auto":
        return f"validation.enabled = {str(v.enabled).lower()}"
    if v.path is not None:
        return "auto: validation.path is set"
    relation = ">=" if images >= AUTO_MIN_IMAGES else "<"
    return f"auto: {images} training images {relation} {AUTO_MIN_IMAGES}"


def _rank(seed: int, item: Item, cfg: RunConfig) -> str:
    """The item's stable hash: its path within its subset's folder, and the seed."""
    folder = cfg.datasets[item.dataset].subsets[item.subset].path
    rel = item.path.relative_to(folder) if item.path.is_relative_to(folder) else item.path
    return hashlib.sha256(f"{seed}:{rel.as_posix()}".encode()).hexdigest()


def held_out(items: list[Item], cfg: RunConfig) -> set[int]:
    """Indices of the items held out: in each dataset, round(fraction * n) of its n holdable
    items (at least 1, and never all of them), those of the smallest hash."""
    v, out = cfg.validation, set()
    for d in range(len(cfg.datasets)):
        pool = [i for i, it in enumerate(items) if it.dataset == d and holdable(it)]
        if len(pool) < 2:
            continue
        k = min(len(pool) - 1, max(1, round(v.fraction * len(pool))))
        out |= set(sorted(pool, key=lambda i: _rank(v.seed, items[i], cfg))[:k])
    return out


def split(cfg: RunConfig, data: DataSet, bucket_step: int,
          control_size: ControlSize | None = None,
          discover: Callable[..., DataSet] = build) -> DataSet:
    """`data` with its validation set in `held`: the items of `validation.path` (nothing held
    out then), or those held out of the training datasets (removed from `items`)."""
    if not enabled(cfg, len(data.items)):
        return data
    v = cfg.validation
    if v.path is not None:
        first = cfg.datasets[0]
        own = first.model_copy(update={"subsets": [SubsetConfig(path=v.path)]})
        return replace(data, held=discover([own], bucket_step, control_size).items)
    out = held_out(data.items, cfg)
    if not out:
        log.warning("validation is on but no image can be held out (a dataset needs 2 "
                    "ordinary images); set validation.path to a folder of its own")
    return replace(data, items=[it for i, it in enumerate(data.items) if i not in out],
                   held=[it for i, it in enumerate(data.items) if i in out])
