"""Video files of a subset as training items: one `Item` per clip, bucketed by (width, height,
frames), with what was skipped and why, and the resampling and rounding `check` reports.

`data.discover.build` calls `clip_items` for the video files it finds beside the images.
Frame counts are the family's (`ClipRule.frame_rule`, Wan's 4N+1), the frame rate the
dataset's or the family's; each video is probed once (PyAV, first frame decoded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from difftune.config import DatasetConfig, SubsetConfig
from difftune.data.buckets import Bucket, assign_bucket
from difftune.data.captions import CaptionAugment
from difftune.data.items import DataSet, Item, caption_of, read_caption, skip
from difftune.data.images import upscale_problem
from difftune.data.video import (Clip, FrameRule, frame_files, plan_clips, probe_frames,
                                 probe_video, round_frames, target_frames)

if TYPE_CHECKING:
    from difftune.families.base import Family
    from difftune.families.specs import FamilySpec

log = logging.getLogger("difftune.data")


@dataclass(frozen=True)
class ClipRule:
    """A family's video facts: its valid frame counts and its default frame rate."""

    frame_rule: FrameRule
    fps: float


def clip_rule(family: Family | FamilySpec) -> ClipRule | None:
    """A family's (or its spec's) `ClipRule` from its `frame_rule` and `fps` facts (None:
    images only)."""
    rule, fps = family.frame_rule, family.fps
    return None if rule is None or fps is None else ClipRule(rule, fps)


def frame_counts(ds: DatasetConfig, rule: FrameRule) -> tuple[list[int], str | None]:
    """The dataset's frame counts rounded down to `rule`, and a note saying what was rounded
    (None when nothing was)."""
    counts = sorted({round_frames(n, rule) for n in ds.frames})
    changed = [f"{n} -> {round_frames(n, rule)}" for n in ds.frames if round_frames(n, rule) != n]
    if not changed:
        return counts, None
    step, offset = rule
    return counts, (f"frames rounded down to {step}N+{offset}, the counts this model trains: "
                    f"{', '.join(changed)}")


def clip_items(paths: list[Path], sub: SubsetConfig, ds: DatasetConfig, where: tuple[int, int],
               buckets: list[Bucket], rule: ClipRule | None, out: DataSet) -> list[Item]:
    """The clip items of a subset's video files (`where` = (dataset, subset) indices), bucketed
    among `buckets` (the dataset's first resolution's); unusable videos are recorded in
    `out.skipped`, resampled sources and rounded frame counts in `out.notes`."""
    why = _refusal(sub, rule) if paths else None
    if why is not None:
        for path in paths:
            skip(out, path, why, "video")
        return []
    if not paths:
        return []
    assert rule is not None
    fps = ds.fps or rule.fps
    counts, note = frame_counts(ds, rule.frame_rule)
    if note is not None:
        _note(out, f"datasets[{where[0]}]: {note}")
    items, augment = [], CaptionAugment.from_subset(sub)
    for path in paths:
        made = _video_clips(path, ds, counts, fps, buckets, rule.frame_rule, out)
        if isinstance(made, str):
            skip(out, path, made, "video")
            continue
        size, bucket, clips = made
        if read_caption(path, sub.caption_ext) is None and not sub.default_caption:
            skip(out, path, f"no caption (no {sub.caption_ext} file beside it, and the subset "
                            "has no default_caption)", "video")
            continue
        caption = caption_of(path, sub, out)
        items += [Item(path=path, caption=caption, size=size, bucket=bucket, dataset=where[0],
                       subset=where[1], repeats=sub.repeats, flip=sub.flip, crop=sub.crop,
                       augment=augment, resolution=ds.resolutions[0],
                       regularization=sub.regularization, loss_weight=sub.loss_weight,
                       clip=clip) for clip in clips]
    return items


def frame_folders(folder: Path, recursive: bool, caption_ext: str) -> list[Path]:
    """The folders of frames under `folder`: sub-folders (not hidden) holding images, with a
    caption file beside them (`<folder><caption_ext>`), in path order."""
    ext = caption_ext if caption_ext.startswith(".") else f".{caption_ext}"
    found = folder.rglob("*") if recursive else folder.iterdir()
    return sorted((p for p in found if p.is_dir()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                   and p.parent.joinpath(p.name + ext).is_file() and frame_files(p)),
                  key=lambda p: p.relative_to(folder).as_posix())


def _refusal(sub: SubsetConfig, rule: ClipRule | None) -> str | None:
    """Why a subset's videos cannot be trained at all (None: they can)."""
    if rule is None:
        return "a video, and this model family trains images only"
    if sub.masked() or sub.control_path:
        return "video clips take no masks or control images; keep them in another subset"
    return None


def _note(out: DataSet, note: str) -> None:
    """Record (once) and log a report line `check` prints."""
    if note not in out.notes:
        log.warning("%s", note)
        out.notes.append(note)


def _video_clips(path: Path, ds: DatasetConfig, counts: list[int], fps: float,
                 buckets: list[Bucket], rule: FrameRule, out: DataSet
                 ) -> tuple[tuple[int, int], Bucket, list[Clip]] | str:
    """A video's size, bucket and clips, or why it is skipped (unreadable, too short, so far
    from every bucket's shape that covering it would be enormous)."""
    try:
        info = probe_frames(path, fps) if path.is_dir() else probe_video(path)
    except ValueError as err:
        return str(err)
    bucket = assign_bucket(info.size, buckets)
    problem = upscale_problem(info.size, bucket)
    if problem:
        return problem
    total = target_frames(info, fps)
    plan = plan_clips(total, counts, ds.clips, ds.clip_stride, ds.clip_count, ds.max_frames,
                      rule)
    if isinstance(plan, str):
        return plan
    if abs(info.fps - fps) > 1e-3:
        _note(out, f"{path}: {info.fps:g} fps resampled to {fps:g} fps (datasets.fps; motion "
                   "trains at the model's speed)")
    return info.size, bucket, [Clip(start, n, fps, info.fps) for start, n in plan]
