"""`difftune check`'s lines about masked subsets: their images and clips, the mean share of
pixels each mask trains and the weight of the rest. Apart from `masks` because it reads both
image masks (`masks.mean_area`) and clip masks (`clip_masks.mask_area`), which builds on
`masks`."""

from __future__ import annotations

from pathlib import Path

from difftune.data.clip_masks import mask_area
from difftune.data.discover import Item
from difftune.data.masks import mean_area


def _item_area(item: Item, clips: dict[Path, float]) -> float:
    """`masks.mean_area` of an image item; for a clip, its mask's (`clip_masks.mask_area`, once
    per mask in `clips`)."""
    if item.clip is None or item.mask is None:
        return mean_area(item.path, item.mask, item.size)
    if item.mask not in clips:
        clips[item.mask] = mask_area(item.mask)
    return clips[item.mask]


def describe(items: list[Item]) -> list[str]:
    """`difftune check`'s lines about masks: per masked subset, its images, their mean masked
    area (the share of pixels trained at full weight) and the weight of the rest."""
    subsets: dict[tuple[int, int], list[Item]] = {}
    for it in items:
        if it.masked:
            subsets.setdefault((it.dataset, it.subset), []).append(it)
    lines, clip_areas = [], {}
    for (d, s), group in sorted(subsets.items()):
        area = sum(_item_area(it, clip_areas) for it in group) / len(group)
        source = "alpha channel" if group[0].alpha_mask else "mask files"
        clips = sum(it.clip is not None for it in group)
        what = "clips" if clips == len(group) else "images" if not clips else "images and clips"
        lines.append(f"masked loss: datasets[{d}].subsets[{s}]: {len(group)} {what} masked by "
                     f"{source}, mean masked area {area:.0%}, unmasked_weight "
                     f"{group[0].unmasked_weight:g}")
    return lines
