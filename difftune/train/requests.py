"""Requests to a training run from outside it: "sample now" and "save now".

Another process (`difftune request sample|save RUN_DIR`, the web app's buttons) writes an empty
file `<run_dir>/requests/<kind>`; the loop looks after each step, honours what it finds (a sample
event, or a LoRA file and a resume checkpoint, as a scheduled one would) and deletes the file.
A file, not a socket or a signal, so that the CLI, the UI and a shell script all ask the same way,
and a request made while no run trains waits for the next one (a resume) in that folder.

The look costs one `stat` per step while no request is pending: the folder exists only while a
request does (the loop removes it once empty).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable, Literal

log = logging.getLogger("difftune")

FOLDER = "requests"
SAMPLE, SAVE = "sample", "save"
KINDS: tuple[str, ...] = (SAMPLE, SAVE)
Kind = Literal["sample", "save"]

# Unknown files already warned about (by path): a stray file is named once, not every step.
_warned: set[Path] = set()


def folder(run_dir: Path) -> Path:
    """Where `run_dir`'s pending requests live."""
    return Path(run_dir) / FOLDER


def make_request(run_dir: Path, kind: Kind) -> Path:
    """Ask the run training in `run_dir` to `kind` ("sample" or "save") after its current step;
    returns the request file. Atomic (written aside, then renamed), and safe while the run
    trains: the loop may remove the empty folder between our mkdir and our write, so that
    write is tried again."""
    if kind not in KINDS:
        raise ValueError(f"unknown request {kind!r}; one of: {', '.join(KINDS)}")
    where = folder(run_dir)
    for _ in range(5):
        where.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{kind}-", suffix=".tmp", dir=where)
        except FileNotFoundError:  # the loop removed the (then empty) folder: make it again
            continue
        os.close(fd)  # a non-empty folder is never removed, so the rename below finds it
        target = where / kind
        os.replace(tmp, target)
        return target
    raise OSError(f"cannot write a request into {where}: the folder keeps disappearing")


def pending(run_dir: Path) -> set[str]:
    """The kinds of request waiting in `run_dir` (one `stat` when there are none). Hidden
    files are requests being written; any other unknown file is warned about once and left."""
    where = folder(run_dir)
    try:
        names = os.listdir(where)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    found = set()
    for name in names:
        if name in KINDS:
            found.add(name)
        elif not name.startswith(".") and where / name not in _warned:
            _warned.add(where / name)
            log.warning("%s is not a request (known: %s); it is ignored", where / name,
                        ", ".join(KINDS))
    return found


def clear(run_dir: Path, kinds: Iterable[str]) -> None:
    """Delete the request files of `kinds` (they were honoured), and the folder once empty."""
    where = folder(run_dir)
    for kind in kinds:
        (where / kind).unlink(missing_ok=True)
    try:
        where.rmdir()
    except OSError:  # not empty (another request, a stray file) or already gone
        pass


def take_requests(run_dir: Path) -> set[str]:
    """The kinds of request waiting in `run_dir`, deleted: the caller honours them now."""
    found = pending(run_dir)
    if found:
        clear(run_dir, found)
    return found
