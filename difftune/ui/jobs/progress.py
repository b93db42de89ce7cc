"""What the jobs list shows of each run: its name, step/total, ETA, last loss and newest sample.

The jobs page refreshes every second for every job, so nothing is read that has not changed:
a run's figures are recomputed only when its run folder, metrics file, resolved config or
samples folder changed (their stat), and the samples folder is listed again only when it
changed (a new image changes the folder's modification time), never its images opened.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from difftune.ui import runs
from difftune.ui.run_outputs import SAMPLE_NAME, STEP_LABEL
from difftune.ui.security import Roots

CACHE_MAX = 512  # run folders remembered; a list longer than this is re-read, not wrong


@dataclass(frozen=True)
class Progress:
    """A run's progress as its files say: `name` (the run folder's name, which the app keeps
    unique), `step` of `total`, `eta_s` (seconds left at its logged speed, None when done or
    unknown), `loss` (the last logged), `sample` (the newest sample image: the first prompt
    of the latest step sampled), `finished` (the run's final file is written or its last
    step logged)."""

    name: str
    step: int = 0
    total: int | None = None
    eta_s: float | None = None
    loss: float | None = None
    sample: str | None = None
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


_cache: dict[Path, tuple[tuple[Any, ...], Progress]] = {}
_lock = threading.Lock()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when `path` changes (inode, size, modification time), None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def progress(run_dir: Path, roots: Roots) -> Progress:
    """The progress of the run in `run_dir` (files under `roots` only), recomputed only when
    one of the files it comes from changed."""
    run_dir = Path(run_dir)
    stamp = tuple(_stamp(p) for p in (run_dir, run_dir / runs.METRICS, run_dir / runs.CONFIG,
                                      run_dir / "samples"))
    with _lock:
        known = _cache.get(run_dir)
    if known is not None and known[0] == stamp:
        return known[1]
    summary = runs.summary(run_dir, roots)
    loss = summary.loss_smoothed if summary.loss_smoothed is not None else summary.loss
    made = Progress(name=run_dir.name, step=summary.step, total=summary.total_steps,
                    eta_s=summary.eta_s, loss=loss, sample=last_sample(run_dir, roots),
                    finished=summary.finished)
    with _lock:
        if len(_cache) >= CACHE_MAX:
            _cache.clear()
        _cache[run_dir] = (stamp, made)
    return made


def last_sample(run_dir: Path, roots: Roots) -> str | None:
    """The newest sample image of a training: the lowest prompt index of the highest step
    sampled (`samples/step-NNNNNN_II_<slug>.png`), one under `roots`; None when there is none.
    Only names are read (one listing of the folder)."""
    folder = runs.readable(run_dir / "samples", run_dir, roots)
    if folder is None:
        return None
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    found: list[tuple[int, int, str]] = []
    for entry in entries:
        match = SAMPLE_NAME.match(entry.name)
        step = STEP_LABEL.match(match["label"]) if match else None
        if match is not None and step is not None:  # not a grid, a stray file, ...
            found.append((int(step[1]), -int(match["index"]), entry.path))
    for *_, path in sorted(found, reverse=True):
        if runs.readable(Path(path), run_dir, roots) is not None:  # not a link elsewhere
            return path
    return None


def clock(seconds: float) -> str:
    """A duration as a clock shows it: 0:42, 12:05, 1:02:09."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
