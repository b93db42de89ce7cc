"""The report's checks: from measurements and caption files to findings, each naming its image.

Thresholds are settings, stated in the report: near-duplicates are perceptual hashes at most
`duplicate_distance` bits apart (of 64); blurred is a sharpness below `blur_threshold`
(variance of the Laplacian at 512 px, OpenCV's customary 100); an image is upscaled when it is
smaller than the bucket it trains in (the factor is the resize); an aspect ratio beyond
`max_aspect` is extreme; a caption is cut when it holds more tokens than the family's text
encoder reads.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from difftune.data.buckets import Bucket, assign_bucket
from difftune.dataset_report.measure import Measured, near_pairs

if TYPE_CHECKING:
    from difftune.config import SubsetConfig


TAG_WORDS = 5


@dataclass(frozen=True)
class TokenLimit:
    """How many tokens the family's text encoder reads (`max_length`), a counter of a
    caption's tokens, and whether that count is `exact` (its tokenizer) or approximate."""

    max_length: int
    count: Callable[[str], int]
    exact: bool
    source: str


@dataclass(frozen=True)
class Settings:
    """The thresholds the checks use (see the module's docstring)."""

    duplicate_distance: int = 6
    blur_threshold: float = 100.0
    max_aspect: float = 3.0
    trigger: str = ""


@dataclass(frozen=True)
class Folder:
    """One folder reported on: its images, how their captions are named, the buckets they train
    in (empty: no training resolution known), its subset (masks and edit pairs), if any, and
    whether the family trains clips (then its videos, files and folders of frames, are
    counted as videos and their frames are not reported on as images)."""

    path: Path
    caption_ext: str = ".txt"
    recursive: bool = True
    buckets: tuple[Bucket, ...] = ()
    subset: "SubsetConfig | None" = None
    clips: bool = False


@dataclass(frozen=True)
class Finding:
    """One problem: the `check` that found it, the `image`, what is wrong (`detail`), its
    figure (`value`: distance, sharpness, factor, ratio or tokens) and for a pair the `other`."""

    check: str
    image: str
    detail: str
    value: float | None = None
    other: str | None = None


@dataclass
class Report:
    """All findings of a dataset, the thresholds used, tag frequencies and the token limit."""

    images: int = 0
    videos: int = 0  # video files and folders of frames, where the family trains clips
    root: str = ""  # the (first) folder reported on; the table names images relative to it
    settings: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    tags: dict[str, int] = field(default_factory=dict)
    token_limit: dict | None = None

    def to_dict(self) -> dict:
        """A JSON-ready dict (findings as dicts, counted by check in `counts`)."""
        counts = Counter(f.check for f in self.findings)
        return {"images": self.images, "videos": self.videos, "root": self.root,
                "settings": self.settings, "counts": dict(counts),
                "findings": [asdict(f) for f in self.findings], "tags": self.tags,
                "token_limit": self.token_limit}


def image_findings(m: Measured, folder: Folder, s: Settings) -> list[Finding]:
    """Blur, upscaling and aspect ratio of one decoded image (or that it is unreadable)."""
    name = str(m.path)
    if m.error:
        return [Finding("unreadable", name, m.error)]
    out = []
    if m.sharpness < s.blur_threshold:
        out.append(Finding("blurred", name, f"sharpness {m.sharpness:.0f} < {s.blur_threshold:g}",
                           round(m.sharpness, 1)))
    w, h = m.size
    if folder.buckets:
        bw, bh = assign_bucket(m.size, list(folder.buckets))
        factor = max(bw / w, bh / h)
        if factor > 1.0:
            out.append(Finding("upscaled", name, f"{w}x{h} is upscaled {factor:.2f}x to its "
                               f"{bw}x{bh} bucket", round(factor, 2)))
    ratio = max(w / h, h / w)
    if ratio > s.max_aspect:
        out.append(Finding("aspect", name, f"{w}x{h}: aspect ratio {ratio:.1f}:1 > "
                           f"{s.max_aspect:g}:1 (heavily cropped or tiny in its bucket)",
                           round(ratio, 2)))
    return out


def caption_findings(image: Path, text: str | None, s: Settings, limit: TokenLimit | None
                     ) -> list[Finding]:
    """Missing, empty, trigger-less or over-long caption of one image."""
    name = str(image)
    if text is None:
        return [Finding("caption_missing", name, "no caption file")]
    if not text:
        return [Finding("caption_empty", name, "the caption file is empty")]
    out = []
    if s.trigger and not re.search(rf"(?<!\w){re.escape(s.trigger)}(?!\w)", text, re.I):
        out.append(Finding("trigger_missing", name, f"the caption lacks {s.trigger!r}"))
    if limit is not None:
        tokens = limit.count(text)
        if tokens > limit.max_length:
            about = "" if limit.exact else "about "
            out.append(Finding("caption_too_long", name, f"{about}{tokens} tokens > "
                               f"{limit.max_length}: the end is cut", tokens))
    return out


def pair_findings(image: Path, sub: "SubsetConfig | None") -> list[Finding]:
    """A masked subset's missing mask, an edit subset's missing control image."""
    from difftune.data.pairs import _partner, partners

    if sub is None:
        return []
    out = []
    if sub.mask_path is not None:
        mask = _partner(image, sub.path, sub.mask_path, what="mask")
        if isinstance(mask, str):
            out.append(Finding("mask_missing", str(image), mask))
    if sub.control_path:
        found = partners(image, sub)
        if isinstance(found, str):
            out.append(Finding("pair_incomplete", str(image), found))
    return out


def duplicate_findings(measured: list[Measured], s: Settings) -> list[Finding]:
    """Every pair of images whose perceptual hashes are at most `duplicate_distance` apart."""
    good = [m for m in measured if m.error is None]
    return [Finding("near_duplicate", str(good[i].path), f"{d} bits from {good[j].path.name}",
                    d, str(good[j].path))
            for i, j, d in near_pairs([m.phash for m in good], s.duplicate_distance)]


def tag_counts(captions: list[str]) -> dict[str, int]:
    """How many captions hold each comma-separated tag (lower-cased; a piece of more than
    `TAG_WORDS` words is a sentence, not a tag), most frequent first."""
    counts: Counter[str] = Counter()
    for text in captions:
        counts.update({t.strip().lower() for t in text.split(",")
                       if t.strip() and len(t.split()) <= TAG_WORDS})
    return dict(counts.most_common())
