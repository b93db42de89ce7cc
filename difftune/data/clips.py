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
from difftune.data.clip_masks import find_clip_mask, mask_problem
from difftune.data.video import (Clip, FrameRule, VideoInfo, frame_files, plan_clips,
                                 probe_frames, probe_video, round_frames, target_frames)
from difftune.errors import DataError

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
               buckets: dict[int, list[Bucket]], rule: ClipRule | None, out: DataSet
               ) -> list[Item]:
    """The clip items of a subset's video files (`where` = (dataset, subset) indices): per
    clip, one per dataset resolution (`buckets` maps each resolution to its candidate buckets,
    as for images); unusable videos are recorded in `out.skipped`, resampled sources and
    rounded frame counts in `out.notes`. A masked subset's clips take their masks
    (`data.clip_masks`); a missing or mismatched mask is a `DataError` naming the files."""
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
    items, problems = [], []
    for path in paths:
        made = _video_clips(path, ds, counts, fps, rule.frame_rule, out)
        if isinstance(made, str):
            skip(out, path, made, "video")
            continue
        if read_caption(path, sub.caption_ext) is None and not sub.default_caption:
            skip(out, path, f"no caption (no {sub.caption_ext} file beside it, and the subset "
                            "has no default_caption)", "video")
            continue
        mask = _mask_of(path, made[0], sub)
        if isinstance(mask, str):
            problems.append(f"{path.name}: {mask}")
            continue
        items += _placed(path, made, mask, sub, where, buckets, out)
    if problems:
        raise DataError(f"datasets[{where[0]}].subsets[{where[1]}].mask_path: {len(problems)} "
                        f"video(s) have no usable mask: {'; '.join(problems[:5])}. Every video "
                        "of a masked subset needs a mask video, folder of mask frames or still "
                        "mask image of the same name, its size and frame count")
    return items


def _mask_of(path: Path, info: VideoInfo, sub: SubsetConfig) -> Path | str | None:
    """The video's mask (None in an unmasked subset), or why it has no usable one."""
    if sub.mask_path is None:
        return None
    mask = find_clip_mask(path, sub.path, sub.mask_path)
    return mask if isinstance(mask, str) else (mask_problem(path, mask, info) or mask)


def _placed(path: Path, made: tuple[VideoInfo, list[Clip]], mask: Path | None,
            sub: SubsetConfig, where: tuple[int, int], buckets: dict[int, list[Bucket]],
            out: DataSet) -> list[Item]:
    """A video's clip items at every resolution its size fits (skipped, with the reason, at a
    resolution whose buckets are all too far from its shape)."""
    info, clips = made
    caption, augment, items = caption_of(path, sub, out), CaptionAugment.from_subset(sub), []
    for res, candidates in buckets.items():
        bucket = assign_bucket(info.size, candidates)
        problem = upscale_problem(info.size, bucket)
        if problem:
            skip(out, path, problem if len(buckets) == 1 else f"at resolution {res}: {problem}",
                 "video")
            continue
        items += [Item(path=path, caption=caption, size=info.size, bucket=bucket,
                       dataset=where[0], subset=where[1], repeats=sub.repeats, flip=sub.flip,
                       crop=sub.crop, augment=augment, resolution=res,
                       regularization=sub.regularization, loss_weight=sub.loss_weight,
                       clip=clip, mask=mask, unmasked_weight=sub.unmasked_weight)
                  for clip in clips]
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
    if sub.alpha_mask or sub.control_path:
        return ("video clips take no control images and no alpha_mask (give masks in "
                "mask_path); keep them in another subset")
    return None


def _note(out: DataSet, note: str) -> None:
    """Record (once) and log a report line `check` prints."""
    if note not in out.notes:
        log.warning("%s", note)
        out.notes.append(note)


def _video_clips(path: Path, ds: DatasetConfig, counts: list[int], fps: float,
                 rule: FrameRule, out: DataSet) -> tuple[VideoInfo, list[Clip]] | str:
    """A video's probed facts and clips, or why it is skipped (unreadable, too short)."""
    try:
        info = probe_frames(path, fps) if path.is_dir() else probe_video(path)
    except ValueError as err:
        return str(err)
    total = target_frames(info, fps)
    plan = plan_clips(total, counts, ds.clips, ds.clip_stride, ds.clip_count, ds.max_frames,
                      rule)
    if isinstance(plan, str):
        return plan
    if info.rotation:
        _note(out, f"{path}: rotated {info.rotation} degrees by its metadata; decoded upright "
                   f"at {info.size[0]}x{info.size[1]}")
    if abs(info.fps - fps) > 1e-3:
        _note(out, f"{path}: {info.fps:g} fps resampled to {fps:g} fps (datasets.fps; motion "
                   "trains at the model's speed)")
    return info, [Clip(start, n, fps, info.fps) for start, n in plan]
