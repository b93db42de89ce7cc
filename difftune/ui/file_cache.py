"""Reading a run folder again only where it changed: folder listings and values derived from
files, kept while what `stat` says of them stays the same.

The run page polls a run folder every second, and a long run holds thousands of samples and
hundreds of checkpoints. A folder's listing is kept until the folder's modification time (or
inode) changes, which adding, removing or renaming an entry does; a value made from a file
(a safetensors header, a checkpoint's size) is kept until that file's inode, modification
time or size changes. Files are written aside and renamed into place by the trainer, so a
changed file has a new inode.

Timestamps are coarse (a few milliseconds on most file systems): an entry added in the same
tick as a listing would leave the folder's time unchanged. So a stamp is trusted only once it
is older than `SETTLED_NS` at the moment the value was made ("racily clean" otherwise, as git
calls it); until then the value is made again at each call.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
Stamp = tuple[int, int, int]  # (inode, modification time in ns, size)
SETTLED_NS = 1_000_000_000  # a stamp this old when read cannot hide a later change
MAX_ENTRIES = 20_000  # per cache: a bound on memory for an app left open on many runs


def stamp(path: Path) -> Stamp | None:
    """What `stat` says of `path` (links followed) that changes when it is written, or None
    when it does not exist or cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _settled(when: Stamp, made_ns: int) -> bool:
    """Whether a value made at `made_ns` from a file stamped `when` can be kept: the file's
    time was already a full `SETTLED_NS` in the past, so a later write changes it."""
    return made_ns - when[1] >= SETTLED_NS


@dataclass(frozen=True)
class Entry:
    """One entry of a folder: its name, its stamp (links followed), what it is."""

    name: str
    stamp: Stamp
    is_dir: bool
    is_link: bool


class StampCache(Generic[T]):
    """Values made from a path, each kept while the path's stamp stays the same (and settled)."""

    def __init__(self) -> None:
        self._known: dict[object, tuple[Stamp, T]] = {}
        self._lock = threading.Lock()
        self.made = 0  # how many values were made (not taken from the cache): for tests

    def get(self, key: object, path: Path, make: Callable[[], T]) -> T | None:
        """The value for `key`, made by `make()` when `path`'s stamp changed since it was
        last made; None when `path` does not exist."""
        now = stamp(path)
        if now is None:
            with self._lock:
                self._known.pop(key, None)
            return None
        with self._lock:
            known = self._known.get(key)
        if known is not None and known[0] == now:
            return known[1]
        made_ns = time.time_ns()
        value = make()
        self.made += 1
        if _settled(now, made_ns):
            with self._lock:
                if len(self._known) >= MAX_ENTRIES:
                    self._known.clear()
                self._known[key] = (now, value)
        return value


_listings: StampCache[dict[str, Entry]] = StampCache()


def entries(folder: Path) -> dict[str, Entry]:
    """The entries of `folder` by name ({} when it is not a readable folder), listed again
    only when the folder changed. Entries that vanish while listed are left out."""
    folder = Path(folder)
    return _listings.get(folder, folder, lambda: _list(folder)) or {}


def _list(folder: Path) -> dict[str, Entry]:
    """One listing of `folder`: each entry with its stamp (links followed)."""
    out: dict[str, Entry] = {}
    try:
        with os.scandir(folder) as found:
            for item in found:
                try:
                    st = item.stat()
                    is_dir = item.is_dir()
                except OSError:  # removed meanwhile, or a link leading nowhere
                    continue
                out[item.name] = Entry(item.name, (st.st_ino, st.st_mtime_ns, st.st_size),
                                       is_dir, item.is_symlink())
    except OSError:
        return {}
    return out
