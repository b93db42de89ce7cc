"""Assembling a report: every folder's images measured, captions read, checks run; and the
token limit a family's text encoder puts on captions (exact with its tokenizer, when the
model folder holds it, else approximate)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict
from pathlib import Path

from difftune.caption.run import caption_path
from difftune.data.clips import frame_folders
from difftune.data.discover import list_images
from difftune.data.video import VIDEO_EXTENSIONS
from difftune.dataset_report.checks import (Folder, Report, Settings, TokenLimit,
                                            caption_findings, duplicate_findings,
                                            image_findings, pair_findings, tag_counts)
from difftune.dataset_report.measure import SIDE, measure_all

WORDS = re.compile(r"\w+|[^\w\s]")
# Without the tokenizer: BPE tokenizers split English into about one token per word or
# punctuation mark, a little more for rare words; plus the start and end tokens.
TOKENS_PER_WORD = 1.2


def _read(path: Path) -> str | None:
    """A caption file's stripped text; None when missing or unreadable as UTF-8."""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError):
        return None


def build_report(folders: list[Folder], settings: Settings,
                 limit: TokenLimit | None = None) -> Report:
    """The report on every image of `folders`, near-duplicates looked for across all of them."""
    report = Report(root=str(folders[0].path) if folders else "", settings={**asdict(settings), "blur_measure": f"variance of the Laplacian "
                              f"of the grayscale at {SIDE} px long side"})
    captions, measured = [], []
    for folder in folders:
        images, videos = _sources(folder)
        report.videos += len(videos)
        found = measure_all(images)
        measured += found
        for m in found:
            report.findings += image_findings(m, folder, settings)
            if m.error:
                continue  # not an image: its caption does not matter
            text = _read(caption_path(m.path, folder.caption_ext))
            report.findings += caption_findings(m.path, text, settings, limit)
            report.findings += pair_findings(m.path, folder.subset)
            captions += [text] if text else []
    report.images = len(measured)
    report.findings += duplicate_findings(measured, settings)
    report.tags = tag_counts(captions)
    if limit is not None:
        report.token_limit = {"max_length": limit.max_length, "exact": limit.exact,
                              "source": limit.source}
    return report


def _sources(folder: Folder) -> tuple[list[Path], list[Path]]:
    """A folder's images and, where the family trains clips, its videos: video files and
    folders of frames (each one clip source, as the run reads it: data/discover.py), whose
    frames are then no images of their own."""
    images = list_images(folder.path, folder.recursive)
    if not folder.clips:
        return images, []
    frames = frame_folders(folder.path, folder.recursive, folder.caption_ext)
    videos = list_images(folder.path, folder.recursive, VIDEO_EXTENSIONS) + frames
    return [p for p in images if not any(p.is_relative_to(f) for f in frames)], videos


def approximate_tokens(text: str) -> int:
    """About how many tokens a BPE tokenizer makes of `text` (see `TOKENS_PER_WORD`)."""
    return math.ceil(len(WORDS.findall(text)) * TOKENS_PER_WORD) + 2


def token_limit(family: str, model_folder: Path | None) -> TokenLimit:
    """The caption limit of `family`: the shortest `max_length` of the text encoders whose
    token sequence the denoiser reads (a pooled-only encoder's cut matters less), counted by
    that encoder's tokenizer from `model_folder` when it is there, else approximately."""
    from difftune.families.registry import spec

    fam = spec(family)
    seq = [te for te in fam.text_encoders if te.hidden != "none" or te.layers] or list(
        fam.text_encoders)
    te = min(seq, key=lambda t: t.max_length)
    sub = next((tok for name, _, tok in fam.encoder_parts if name == te.name), None)
    where = model_folder / sub if model_folder is not None and sub else None
    if where is not None and where.is_dir():
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
            return TokenLimit(te.max_length, lambda t: len(tok(t).input_ids), True,
                              f"{family} {te.name} tokenizer ({where})")
        except (OSError, ValueError):
            pass
    return TokenLimit(te.max_length, approximate_tokens, False,
                      f"{family} {te.name}, approximate count ({TOKENS_PER_WORD} tokens a word: "
                      "no tokenizer in the model folder)")
