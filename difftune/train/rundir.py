"""The run folder (`save.dir`): what a previous run left there, the lock a run holds on it,
and the leftovers an interrupted run leaves behind.

A new run never writes into a folder that holds another run's results (a LoRA, checkpoints,
embeddings, metrics, samples) unless it resumes that run or `save.overwrite` is set, and only
one process at a time works in a folder: a second run on the same `save.dir` would interleave
metrics and replace the first one's files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

from difftune.config import RunConfig
from difftune.errors import ConfigError, EnvironmentProblem

log = logging.getLogger("difftune")

CHECKPOINTS = "checkpoints"


def _listed(folder: Path, pattern: str) -> list[Path]:
    """Files matching `pattern` directly in `folder` (none when it does not exist)."""
    return sorted(p for p in folder.glob(pattern) if p.is_file()) if folder.is_dir() else []


def previous_outputs(out: Path) -> list[str]:
    """What an earlier run left in `out` that a new run would replace or mix with.

    Only results count: LoRA files, checkpoint folders (complete or not), embedding files,
    a metrics file with rows, sample images. A folder holding only a log, a resolved config or
    a cache (what a run refused before its first step leaves) is free to use.
    """
    return list(outputs_in(out))


def outputs_in(out: Path) -> Iterator[str]:
    """`previous_outputs` one at a time (relative names), so a caller asking only whether a
    folder holds any result stops at the first (a run folder may hold thousands of samples)."""
    yield from (p.name for p in _listed(out, "*.safetensors"))
    ckpts = out / CHECKPOINTS
    if ckpts.is_dir():
        yield from (f"{CHECKPOINTS}/{p.name}" for p in sorted(ckpts.iterdir()))
    yield from (f"embeddings/{p.name}" for p in _listed(out / "embeddings", "*.safetensors"))
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        yield metrics.name
    yield from (f"samples/{p.name}" for p in _listed(out / "samples", "*.png"))


def refuse_overwrite(cfg: RunConfig) -> None:
    """Stop before anything heavy when save.dir holds a previous run's results."""
    out = cfg.save.dir
    if cfg.save.overwrite or not out.is_dir():
        return
    existing = previous_outputs(out)
    if existing:
        raise ConfigError(
            f"save.dir {out} already holds a previous run's outputs ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); difftune never overwrites what a run "
            "made. Continue that run with --resume latest, choose a new save.dir, or set "
            "save.overwrite = true")


def clear_for_overwrite(cfg: RunConfig) -> None:
    """With `save.overwrite`, remove the previous run's checkpoints: a later `--resume latest`
    must never pick a checkpoint of the run this one replaced."""
    ckpts = cfg.save.dir / CHECKPOINTS
    if not cfg.save.overwrite or not ckpts.is_dir():
        return
    old = [p for p in ckpts.iterdir() if p.is_dir()]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    if old:
        log.warning("save.overwrite: removed %d checkpoint folder(s) of the previous run in %s",
                    len(old), ckpts)


def clean_leftovers(out: Path) -> None:
    """Remove what an interrupted run left half-written: temporary checkpoint folders and
    temporary LoRA files. A checkpoint caught between its two renames (old one moved aside,
    new one not yet in place) is first put back, so nothing complete is lost."""
    ckpts = out / CHECKPOINTS
    if ckpts.is_dir():
        for aside in ckpts.glob(".old-step-*"):
            final = ckpts / aside.name.removeprefix(".old-").rsplit("-", 1)[0]
            if not final.exists():
                aside.rename(final)
                log.warning("restored checkpoint %s (a save was interrupted)", final)
            else:
                shutil.rmtree(aside, ignore_errors=True)
        for tmp in ckpts.glob(".tmp-step-*"):
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("removed %s (a save interrupted by the previous run)", tmp)
    for tmp in _listed(out, ".*.tmp") + _listed(out / "embeddings", ".*.tmp"):
        tmp.unlink(missing_ok=True)


class RunLock:
    """An exclusive lock on a run folder for as long as the run lives: `fcntl.flock` on the
    folder itself, so nothing is written to take it, and the kernel drops it when the
    process ends, even by kill -9."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock (creating the folder), or raise `ConfigError` naming the process
        that holds it."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as err:
            raise EnvironmentProblem(f"cannot use save.dir {self.out} ({err.strerror or err}); "
                                     "choose a folder you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(os.fstat(fd).st_ino)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                log.warning("cannot lock %s (%s): a second run on this folder would not be "
                            "stopped", self.out, err)
                return self
            raise ConfigError(
                f"save.dir {self.out} is in use by another difftune run"
                f"{f' (pid {holder})' if holder else ''}; wait for it to end, or choose "
                "another save.dir") from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def training_pid(out: Path) -> str | None:
    """The pid of the run holding `out`'s lock (a run training there now), read without
    taking the lock; None when none does, or when it cannot be told (not Linux)."""
    try:
        return _holder(os.stat(out).st_ino)
    except OSError:
        return None


def _holder(inode: int) -> str | None:
    """The pid holding a flock on the file with this inode, from /proc/locks (Linux; None
    elsewhere or when not found)."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
            return parts[4]
    return None
