"""Reading run folders: what a run is doing and what it has written, from its files alone.

A run folder (`save.dir`) holds `config.resolved.json` (the validated config), `metrics.jsonl`
(one JSON row per logged step, appended while the trainer runs), `samples/<label>_II_<slug>.png`,
`checkpoints/step-NNNNNN/`, the LoRA files (`<name>.safetensors`, `<name>-stepNNNNNN.safetensors`)
and `difftune.log`. Nothing here talks to a process: the UI's run page, the compare page and the
HTTP API all read the same files the CLI writes, so what they show is what is on disk.

Each file is read only when it lies, symbolic links followed, under the app's roots (given as
`roots`; without them, inside the run folder itself): the folder a request names is checked
by the API, and each file inside it here, so a link planted in a run folder never serves a
file from elsewhere.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from difftune.ui.file_cache import StampCache
from difftune.ui.security import PathOutsideRoots, Roots

log = logging.getLogger("difftune")

METRICS = "metrics.jsonl"
CONFIG = "config.resolved.json"
LOG = "difftune.log"
RUN_MARKERS = (METRICS, CONFIG)
# Folders that are never runs nor hold runs: the app's own state, caches, a run's insides.
SKIP_FOLDERS = frozenset({".difftune-ui", ".difftune-jobs", "cache", "__pycache__",
                          "node_modules", "checkpoints", "samples", "tensorboard", "validation"})


def is_run(folder: Path) -> bool:
    """Whether `folder` is a run folder (it holds metrics.jsonl or config.resolved.json)."""
    return any((folder / name).is_file() for name in RUN_MARKERS)


def run_of(path: Path) -> Path | None:
    """The run folder `path` lies in (itself or its nearest ancestor that is a run), or None."""
    for folder in (path, *path.parents):
        if folder.is_dir() and is_run(folder):
            return folder
    return None


def readable(path: Path, run_dir: Path, roots: Roots | None = None) -> Path | None:
    """`path`, a file a run folder holds or names, with its links followed, when it may be
    read: under `roots` (None: inside `run_dir` itself). None for one that leads elsewhere
    or cannot be resolved."""
    within = roots if roots is not None else Roots((Path(run_dir).resolve(),))
    try:
        return within.resolve(Path(path).absolute())
    except PathOutsideRoots:
        return None


# --- metrics.jsonl, read incrementally ---------------------------------------------------------

@dataclass
class _Parsed:
    """The rows parsed so far from one metrics file, and where parsing stopped."""

    inode: int
    offset: int  # bytes consumed: always just after a newline
    head: bytes  # the file's first line, to notice a file rewritten in place
    rows: list[dict[str, Any]] = field(default_factory=list)


_parsed: dict[Path, _Parsed] = {}
_lock = threading.Lock()


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities (a skipped step's loss) replaced by None, recursively:
    JSON has no spelling for them and the API answers strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def _parse_lines(data: bytes) -> list[dict[str, Any]]:
    """Rows of complete JSON lines; a line a kill cut short (invalid JSON) is dropped."""
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(_finite(row))
    return rows


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete row of `path`, parsing only what was appended since the last call.

    The trainer appends line by line, so bytes after the last newline are a row being written
    and wait for the next call. A resume rewrites the file (a new inode), a new run truncates
    it (shorter, or a different first line): either way it is parsed again from the start.
    """
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.readline()
            if not head.endswith(b"\n"):
                return []  # no row is complete yet
            with _lock:
                known = _parsed.get(path)
            if (known is None or known.inode != st.st_ino or known.head != head
                    or st.st_size < known.offset):
                known = _Parsed(st.st_ino, 0, head)
            f.seek(known.offset)
            data = f.read()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n") + 1
    fresh = _Parsed(known.inode, known.offset + end, head, known.rows + _parse_lines(data[:end]))
    with _lock:
        _parsed[path] = fresh
    return fresh.rows


def metrics(run_dir: Path, since: int = 0, roots: Roots | None = None) -> list[dict[str, Any]]:
    """The training-step rows of `run_dir` with step > `since` (all by default), oldest first
    (a sample event's metrics row, written later by its own thread, is `sample_metrics`').

    Safe while the trainer writes: a half-written last line is left for the next call.
    Non-finite numbers come back as None; a metrics file leading outside `roots`, no rows.
    """
    path = readable(Path(run_dir) / METRICS, run_dir, roots)
    rows = _read_metrics(path) if path is not None else []
    return [dict(r) for r in rows if r["step"] > since and "event" not in r]


def sample_metrics(run_dir: Path, roots: Roots | None = None) -> list[dict[str, Any]]:
    """The sample-metrics rows of `run_dir` (one per measured sample event), by step; they
    arrive after the steps that follow their event, so they are read whole each time."""
    path = readable(Path(run_dir) / METRICS, run_dir, roots)
    rows = _read_metrics(path) if path is not None else []
    return sorted((dict(r) for r in rows if r.get("event") == "samples"),
                  key=lambda r: r["step"])


def series(rows: list[dict[str, Any]], key: str, max_points: int = 2000) -> list[list[float]]:
    """[[step, value], ...] of the rows that carry a number under `key`, thinned to at most
    `max_points` by an even stride (the last point always kept) so a long run's chart stays
    light to send and draw."""
    points = [[r["step"], r[key]] for r in rows if isinstance(r.get(key), (int, float))]
    if len(points) <= max_points:
        return points
    stride = -(-len(points) // max_points)
    thinned = points[::stride]
    return thinned if thinned[-1] is points[-1] else [*thinned, points[-1]]


# --- summary -----------------------------------------------------------------------------------

@dataclass
class RunSummary:
    """What a run list or a run header shows: progress, speed, losses, and when it last wrote.

    `eta_s` is (total - step) / it_per_s, None when the run is done or its speed unknown;
    `gpu_mem` is the last row's GPU memory figure (GiB) when the run logs one; `best_val_loss`
    the lowest validation loss with its step (`best_val_step`); `best` save.keep_best's
    winner (best.json: which step, by how much) as one line; `updated` the newest
    modification time (Unix seconds) of its metrics, config or log; `lora` the final LoRA
    file when it exists; `finished` whether it exists or the last step was logged (what
    files say; whether a process still runs is the job queue's to tell).
    """

    name: str
    path: str
    step: int = 0
    total_steps: int | None = None
    it_per_s: float | None = None
    eta_s: float | None = None
    gpu_mem: float | None = None
    loss: float | None = None
    loss_smoothed: float | None = None
    best_val_loss: float | None = None
    best_val_step: int | None = None
    updated: float | None = None
    family: str | None = None
    lora: str | None = None
    finished: bool = False
    best: str | None = None  # save.keep_best's verdict (best.json), as one line

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def resolved_config(run_dir: Path, roots: Roots | None = None) -> dict[str, Any]:
    """The run's config.resolved.json as a dict ({} when absent, unreadable or leading
    outside `roots`); parsed again only when the file changed (a copy: change it freely)."""
    path = readable(Path(run_dir) / CONFIG, run_dir, roots)
    if path is None:
        return {}
    doc = _configs.get(path, path, lambda: json_object(path))
    return copy.deepcopy(doc) if doc else {}


_configs: StampCache[dict[str, Any]] = StampCache()


def json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object, parsed ({} when absent, unreadable or not an object):
    config.resolved.json, a LoRA sample set's lora.json."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _gpu_memory(row: dict[str, Any]) -> float | None:
    """The GPU memory figure of a metrics row (any key starting `gpu_mem`), when present."""
    for key, value in row.items():
        if key.startswith("gpu_mem") and isinstance(value, (int, float)):
            return float(value)
    return None


def _updated(run_dir: Path, roots: Roots | None) -> float | None:
    """The newest modification time of the run's metrics, config and log."""
    times = []
    for name in (*RUN_MARKERS, LOG):
        path = readable(run_dir / name, run_dir, roots)
        try:
            if path is not None:
                times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times) if times else None


def final_lora(run_dir: Path, cfg: dict[str, Any]) -> Path | None:
    """Where the run's final LoRA is written (by its resolved config): `<name>.safetensors`,
    or of a two-expert model's pair the first trained expert's (`<name>_high_noise`)."""
    from difftune.config.experts import file_suffix

    name = cfg.get("save", {}).get("name")
    if not isinstance(name, str) or not name:
        return None
    return run_dir / f"{name}{file_suffix(cfg)}.safetensors"


def summary(run_dir: Path, roots: Roots | None = None) -> RunSummary:
    """The state of the run in `run_dir`, read from its files (those under `roots`)."""
    run_dir = Path(run_dir)
    cfg = resolved_config(run_dir, roots)
    rows = metrics(run_dir, 0, roots)
    total = cfg.get("train", {}).get("steps")
    lora = final_lora(run_dir, cfg)
    held = readable(lora, run_dir, roots) if lora is not None else None
    out = RunSummary(name=run_dir.name, path=str(run_dir), total_steps=total,
                     updated=_updated(run_dir, roots), family=cfg.get("model", {}).get("family"),
                     lora=str(lora) if held is not None and held.is_file() else None)
    if rows:
        last = rows[-1]
        out.step, out.loss, out.loss_smoothed = last["step"], last.get("loss"), last.get(
            "loss_smoothed")
        out.it_per_s, out.gpu_mem = last.get("it_per_s"), _gpu_memory(last)
    # The final LoRA file, or (a full fine-tune, embeddings) the last step logged.
    out.finished = out.lora is not None or bool(total and out.step >= total)
    if out.it_per_s and total and not out.finished:
        out.eta_s = (total - out.step) / out.it_per_s
    vals = [(r["val_loss"], r["step"]) for r in rows if isinstance(r.get("val_loss"), float)]
    if vals:
        out.best_val_loss, out.best_val_step = min(vals)
    out.best = _best_line(run_dir, roots)
    return out


def _best_line(run_dir: Path, roots: Roots | None) -> str | None:
    """save.keep_best's winner from best.json ("step 300: fidelity = 0.81, +0.05 on the last
    measured step"), None without one."""
    path = readable(run_dir / "best.json", run_dir, roots)
    doc = json_object(path) if path is not None else {}
    if not isinstance(doc.get("best_step"), int) or not isinstance(doc.get("best"), float):
        return None
    line = f"best: step {doc['best_step']} ({doc.get('keep_best')} = {doc['best']:.4g})"
    margin = doc.get("margin_over_last")
    if isinstance(margin, float) and doc.get("last_step") != doc["best_step"]:
        line += f", {margin:.3g} better than step {doc.get('last_step')}"
    return line


def find_runs(roots: Roots, depth: int = 4) -> list[RunSummary]:
    """Every run folder under the roots, at most `depth` folders deep, newest first.

    Hidden folders, the app's state, caches and a run's own subfolders are not searched, nor
    are symbolic links (which may lead out of the roots, or in circles), and a run folder is
    not searched for runs inside it.
    """
    found: list[Path] = []
    for root in roots.folders:
        _walk(root, depth, found)
    runs = [summary(p, roots) for p in dict.fromkeys(found)]
    return sorted(runs, key=lambda r: r.updated or 0.0, reverse=True)


def searched(folder: Path) -> bool:
    """Whether a search for runs or datasets goes into `folder`: a real folder (not a link),
    not hidden, not the app's state, a cache or a run's insides."""
    return (not folder.name.startswith(".") and folder.name not in SKIP_FOLDERS
            and not folder.is_symlink() and folder.is_dir())


def _walk(folder: Path, depth: int, found: list[Path]) -> None:
    """Add the run folders at or below `folder` (down to `depth` more levels) to `found`."""
    if is_run(folder):
        found.append(folder)
        return
    if depth <= 0:
        return
    try:
        children = sorted(p for p in folder.iterdir() if searched(p))
    except OSError:
        return
    for child in children:
        _walk(child, depth - 1, found)
