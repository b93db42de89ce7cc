"""The report as people and scripts read it: a terminal table, JSON, one summary line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from difftune.dataset_report.checks import Report

# Check -> its heading, in the order the table shows them.
HEADINGS = {
    "unreadable": "unreadable images", "near_duplicate": "near-duplicate pairs",
    "blurred": "blurred", "upscaled": "below the training resolution",
    "aspect": "extreme aspect ratios", "caption_missing": "captions missing",
    "caption_empty": "captions empty", "trigger_missing": "trigger word missing",
    "caption_too_long": "captions cut by the token limit", "mask_missing": "masks missing",
    "pair_incomplete": "edit pairs incomplete"}
ROWS = 20  # rows shown a check; --json has them all
TAGS = 15


def _short(image: str, root: str) -> str:
    """`image` relative to the report's folder where it lies inside it."""
    path, base = Path(image), Path(root)
    return path.relative_to(base).as_posix() if root and path.is_relative_to(base) else image


def summary_line(report: Report) -> str:
    """"dataset: N images; 2 blurred, 1 near-duplicate pairs, ..." (or "no problems found")."""
    counts = Counter(f.check for f in report.findings)
    parts = [f"{counts[c]} {HEADINGS[c]}" for c in HEADINGS if counts[c]]
    videos = (f", {report.videos} video(s) (files or folders of frames; their frames are not "
              "checked as images)") if report.videos else ""
    return (f"dataset report: {report.images} image(s){videos}; "
            + ("; ".join(parts) if parts else "no problems found"))


def to_json(report: Report) -> str:
    """The whole report as indented JSON."""
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False)


def table(report: Report) -> list[str]:
    """The report as terminal lines: each check with its count and flagged images, the
    thresholds used, the token limit and the most frequent tags."""
    s = report.settings
    lines = [summary_line(report), "",
             f"thresholds: near-duplicate <= {s['duplicate_distance']} bits of 64 (perceptual "
             f"hash); blurred: sharpness < {s['blur_threshold']:g} ({s['blur_measure']}); "
             f"extreme aspect > {s['max_aspect']:g}:1"]
    if report.token_limit:
        t = report.token_limit
        lines.append(f"token limit: {t['max_length']} ({t['source']})")
    for check, heading in HEADINGS.items():
        rows = [f for f in report.findings if f.check == check]
        if not rows:
            continue
        lines += ["", f"{heading} ({len(rows)}):"]
        names = [_short(f.image, report.root) for f in rows[:ROWS]]
        width = min(60, max(map(len, names)))
        lines += [f"  {n:<{width}}  {f.detail}" for n, f in zip(names, rows[:ROWS])]
        if len(rows) > ROWS:
            lines.append(f"  ... and {len(rows) - ROWS} more (--json lists all)")
    common = [(t, n) for t, n in report.tags.items() if n > 1][:TAGS]
    if common:
        lines += ["", "most frequent tags: " + ", ".join(f"{t} ({n})" for t, n in common)]
    return lines
