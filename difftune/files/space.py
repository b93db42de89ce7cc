"""Disk space: checked before a run spends time on work it could not write, and every failed
write turned into one message naming the folder, the space free and the space needed.

A full disk is the classic way to lose a run hours in; checking the free space costs one
system call, so the run checks before its first step (and the cache before its first entry),
and a write that still fails mid-run is reported as an `EnvironmentProblem` (exit 2).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

from safetensors import SafetensorError

from difftune.errors import EnvironmentProblem


def free_bytes(folder: Path) -> int | None:
    """Bytes free for an ordinary user in `folder` (or its nearest existing parent)."""
    for place in (folder, *folder.parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


def mib(n: int | None) -> str:
    """A byte count for people."""
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


def no_room(folder: Path, what: str, need: int, fix: str, why: str = "") -> EnvironmentProblem:
    """The error for `what` not fitting in `folder`."""
    return EnvironmentProblem(
        f"cannot write {what} in {folder}{f' ({why})' if why else ''}: {mib(free_bytes(folder))} "
        f"free, about {mib(need)} needed; {fix}")


def check_free(folder: Path, what: str, need: int, fix: str) -> None:
    """Refuse now, before any work, when `folder` has less than `need` bytes free."""
    free = free_bytes(folder)
    if free is not None and free < need:
        raise no_room(folder, what, need, fix, "not enough space")


@contextlib.contextmanager
def writing(folder: Path, what: str, need: int, fix: str) -> Iterator[None]:
    """Turn an OSError of the writes inside (full disk, quota, permissions) into one
    `EnvironmentProblem` naming the folder, the space free and the space needed."""
    try:
        yield
    except OSError as err:
        raise no_room(folder, what, need, fix, err.strerror or str(err)) from err
    except SafetensorError as err:  # safetensors writes files itself and wraps I/O errors
        if "I/O error" not in str(err):
            raise
        raise no_room(folder, what, need, fix, str(err).split("I/O error: ")[-1]) from err
