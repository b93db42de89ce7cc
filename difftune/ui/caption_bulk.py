"""Bulk caption edits over a dataset folder (all its images or a chosen few), and the undo of
the last one.

Operations: `add` a trigger word at the `start` or `end` (joined with ", "; a caption that
already has it there is left alone; an image without a caption file gets one holding the
word), `remove` it from the `start` or `end` (with the ", " or spaces joining it), and
`replace` every occurrence of a text by another (plain text, case-sensitive).

Undo: before any caption changes, the journal `<folder>/.difftune-caption-undo.json` records
each file the edit will touch: its bytes before (or that it did not exist) and a hash of its
bytes after. Undo puts back exactly those bytes (or removes the files the edit created), and
refuses, changing nothing, when a caption was changed since (so a later hand edit is never
lost). The journal lives in the dataset folder (a hidden file the data loader never reads), so
it survives a reload or a restart of the app, never in the app's own folder.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from difftune.ui.datasets import DEFAULT_CAPTION_EXT, caption_path, write_atomic
from difftune.ui.security import Roots

JOURNAL = ".difftune-caption-undo.json"
JOIN = ", "
Op = Literal["add", "remove", "replace"]
Where = Literal["start", "end"]


class NothingToUndo(ValueError):
    """No bulk edit is journaled in the folder, or a caption changed since it (HTTP 409)."""


@dataclass(frozen=True)
class BulkEdit:
    """One bulk edit: `op` with `text` (the trigger word, or the text to find), `where` for
    add/remove, `replacement` for replace."""

    op: Op
    text: str
    where: Where = "start"
    replacement: str = ""

    def apply(self, caption: str) -> str:
        """The caption after this edit."""
        word = self.text.strip()
        if self.op == "replace":
            return caption.replace(self.text, self.replacement)
        parts = [p.strip() for p in caption.split(",")]
        if self.op == "add":
            edge = parts[0] if self.where == "start" else parts[-1]
            if edge == word or not word:
                return caption
            if not caption.strip():
                return word
            return f"{word}{JOIN}{caption.lstrip()}" if self.where == "start" \
                else f"{caption.rstrip()}{JOIN}{word}"
        return _remove(caption, word, self.where)


def _remove(caption: str, word: str, where: Where) -> str:
    """`caption` without `word` at its start or end (with the comma or spaces joining it)."""
    text = caption.strip()
    if not word:
        return caption
    if text == word:
        return ""
    if where == "start" and text.startswith(word):
        rest = text[len(word):]
        if rest[:1] in (",", " "):
            return rest.lstrip(", ")
    if where == "end" and text.endswith(word):
        rest = text[:-len(word)]
        if rest[-1:] in (",", " "):
            return rest.rstrip(", ")
    return caption


def _hash(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes | None:
    """The bytes of `path`, None when there is no such file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _targets(roots: Roots, folder: Path, images: list[str] | None, caption_ext: str
             ) -> list[Path]:
    """The caption files the edit covers (each under the roots, writable), in image order."""
    from difftune.data.discover import list_images

    found = list_images(folder, recursive=True)
    if images is not None:
        chosen = {roots.resolve(i) for i in images}
        unknown = chosen - set(found)
        if unknown:
            raise ValueError(f"{sorted(map(str, unknown))[0]} is not an image of {folder}; "
                             "select images of the folder being edited")
        found = [p for p in found if p in chosen]
    return [roots.resolve(caption_path(p, caption_ext), write=True) for p in found]


def bulk_edit(roots: Roots, folder: str | Path, edit: BulkEdit, images: list[str] | None = None,
              caption_ext: str = DEFAULT_CAPTION_EXT) -> list[Path]:
    """Apply `edit` to the captions of `images` (all the folder's when None) and journal it
    for undo (an edit that changes nothing keeps the last one's journal); returns the caption
    files changed. ValueError for a caption that is not UTF-8
    (nothing changed), PathOutsideRoots for a path outside the roots."""
    where = roots.resolve(folder, write=True)
    if not where.is_dir():
        raise ValueError(f"{folder} is not a folder; pick a dataset folder")
    journal = roots.resolve(where / JOURNAL, write=True)
    changes: list[tuple[Path, bytes | None, bytes]] = []
    for cap in _targets(roots, where, images, caption_ext):
        before = _read(cap)
        try:
            text = "" if before is None else before.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise ValueError(f"{cap} is not UTF-8 text; fix or remove it, then edit") from None
        if before is None and edit.op != "add":
            continue
        after = edit.apply(text).encode("utf-8")
        if after != before:
            changes.append((cap, before, after))
    if not changes:  # the last edit's journal stays: it is still the one to undo
        return []
    entries = [{"file": str(c), "before": None if b is None else base64.b64encode(b).decode(),
                "mode": (c.stat().st_mode & 0o777) if b is not None else None,
                "after": _hash(a)} for c, b, a in changes]
    write_atomic(journal, json.dumps({"edit": edit.__dict__, "files": entries}).encode())
    for cap, before, after in changes:
        write_atomic(cap, after, (cap.stat().st_mode & 0o777) if before is not None else 0o644)
    return [c for c, _, _ in changes]


def last_edit(roots: Roots, folder: str | Path) -> dict[str, Any] | None:
    """The journaled edit of `folder` (its `edit` and `files`), None when there is none."""
    journal = roots.resolve(roots.resolve(folder) / JOURNAL)
    data = _read(journal)
    return None if data is None else json.loads(data)


def undo(roots: Roots, folder: str | Path) -> list[Path]:
    """Put back the captions the last bulk edit of `folder` changed, byte for byte, and drop
    the journal; returns the files restored. NothingToUndo when there is no journal or a
    caption changed since the edit (then nothing is changed)."""
    where = roots.resolve(folder, write=True)
    journal = roots.resolve(where / JOURNAL, write=True)
    recorded = last_edit(roots, where)
    if recorded is None:
        raise NothingToUndo(f"no bulk caption edit of {folder} to undo")
    entries = [(roots.resolve(e["file"], write=True), e) for e in recorded["files"]]
    changed = [str(p) for p, e in entries if _hash(_read(p)) != e["after"]]
    if changed:
        raise NothingToUndo(f"{changed[0]} changed after the bulk edit ({len(changed)} in all); "
                            "undo would lose that change, so nothing was undone")
    for path, e in entries:
        if e["before"] is None:
            path.unlink(missing_ok=True)
        else:
            write_atomic(path, base64.b64decode(e["before"]), e["mode"])
    journal.unlink()
    return [p for p, _ in entries]
