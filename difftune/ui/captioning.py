"""Captioning a dataset folder from the web app: `difftune caption` in the background.

One captioning process per folder, started through the job wrapper (jobs/launch.py: its own
session, its output in a log, its exit in a record), so the app never blocks and neither
closing the app nor a page reload stops it. Its files live in the app's folder
(`captions/<key>/`); the page reads its state from them: the log's "captioning N file(s)"
line gives the total, each "captioned IMAGE: TEXT" line a caption written, the record how it
ended. Stop sends SIGINT (every caption written is kept); starting again resumes, since the
CLI skips captioned images.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftune.ui.jobs.launch import is_alive, start_wrapper

if TYPE_CHECKING:
    from difftune.dataset_report.checks import Report
    from difftune.ui.security import Roots

TOTAL = re.compile(r"captioning (\d+) (?:image|file)\(s\) \((\d+) already captioned\)")
WROTE = re.compile(r"^captioned (.+?): (.*)$")
RECENT = 8
STARTING_S = 10.0  # a start whose pid file is not written yet, for at most this long
MAX_LOG = 64 << 20  # a log read for progress: a line a caption, far below this
STYLES = ("short", "detailed", "tags", "prompt")
# A folder holding one of these may be a captioner (`detect` then says).
MODEL_FILES = ("config.json", "model.onnx", "text_encoder/config.json")


class AlreadyRunning(ValueError):
    """A captioning of the folder runs already."""


@dataclass
class CaptionStatus:
    """What the page shows: `state` ("idle", "running", "stopped", "finished", "failed"),
    captions `done` of `total` this pass, `rate` (images/s) and `eta_s`, the `recent` captions
    (image, caption) newest first, and the last error line when it failed."""

    state: str = "idle"
    done: int = 0
    total: int | None = None
    rate: float | None = None
    eta_s: float | None = None
    recent: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _files(app_folder: Path, folder: Path) -> dict[str, Path]:
    """The log, exit record, pid file and settings of `folder`'s captioning."""
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    base = app_folder / "captions" / key
    return {n: base / f"{n}.{e}" for n, e in (("log", "log"), ("record", "json"),
                                              ("pid", "pid.json"), ("started", "json"))}


def _running(files: dict[str, Path]) -> bool:
    """Whether the folder's captioning process lives (or is being started: its pid file is
    written just after the wrapper starts)."""
    if files["record"].exists():
        return False
    try:
        pid = json.loads(files["pid"].read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return time.time() - _started(files) < STARTING_S
    return is_alive(pid["pid"], pid.get("start"))


def _started(files: dict[str, Path]) -> float:
    """When the captioning was started (0 when unknown)."""
    try:
        return float(json.loads(files["started"].read_text(encoding="utf-8"))["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def start(app_folder: Path, folder: Path, model: Path, style: str = "short",
          prompt: str = "", trigger: str = "", device: str = "auto",
          python: str = sys.executable) -> None:
    """Start captioning `folder`'s uncaptioned images with `model` (ValueError while a
    captioning of the folder runs, or for an unknown style)."""
    if style not in STYLES:
        raise ValueError(f"style {style!r} is not one of {', '.join(STYLES)}")
    files = _files(app_folder, folder)
    if _running(files):
        raise AlreadyRunning(f"{folder} is being captioned already; stop it first")
    argv = [python, "-m", "difftune", "caption", str(folder), "--model", str(model),
            "--style", style, "--device", device, "--no-progress"]
    argv += ["--prompt", prompt] if prompt else []
    argv += ["--trigger", trigger] if trigger else []
    files["log"].parent.mkdir(parents=True, exist_ok=True)
    files["started"].write_text(json.dumps({"time": time.time()}), encoding="utf-8")
    start_wrapper(python, argv, files["log"], files["record"], files["pid"], folder, {})


def start_under(roots: "Roots", folder: str, model: str, style: str = "short",
                prompt: str = "", trigger: str = "") -> Path:
    """`start` for paths a page or request gives: the folder (written to) and the model under
    the roots (PathOutsideRoots otherwise), the model a captioner (`ModelFileError` naming what
    was expected, before anything starts). Returns the folder."""
    from difftune.caption.detect import detect

    target = roots.resolve(folder, write=True)
    if not target.is_dir():
        raise ValueError(f"{folder} is not a folder of images")
    source = roots.resolve(model)
    detect(source)
    start(roots.app_folder, target, source, style, prompt, trigger)
    return target


def stop(app_folder: Path, folder: Path) -> bool:
    """Ask `folder`'s captioning to stop after its current batch (SIGINT); whether one ran."""
    files = _files(app_folder, folder)
    if not _running(files):
        return False
    pid = json.loads(files["pid"].read_text(encoding="utf-8"))["pid"]
    try:
        os.kill(pid, signal.SIGINT)  # the wrapper passes it on to the CLI
    except ProcessLookupError:
        return False
    return True


def status(app_folder: Path, folder: Path) -> CaptionStatus:
    """The state of `folder`'s latest captioning, read from its files."""
    files = _files(app_folder, folder)
    if not files["log"].exists():
        return CaptionStatus()
    lines = _lines(files["log"])
    out = CaptionStatus(state="running" if _running(files) else "finished")
    for line in lines:
        if (m := TOTAL.search(line)) is not None:
            out.total = int(m.group(1))
        elif (w := WROTE.match(line)) is not None:
            out.done += 1
            out.recent.insert(0, {"image": w.group(1), "caption": w.group(2)})
    out.recent = out.recent[:RECENT]
    _ended(files, lines, out)
    _speed(files, out)
    return out


def _lines(log: Path) -> list[str]:
    """The log's lines (all of them: each caption written is one), [] when unreadable."""
    try:
        with open(log, "rb") as f:
            return f.read(MAX_LOG).decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _ended(files: dict[str, Path], lines: list[str], out: CaptionStatus) -> None:
    """Stopped (exit 130 or a stop signal) or failed (another non-zero exit, with the error)."""
    try:
        record = json.loads(files["record"].read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if out.state != "running":  # gone without writing how it ended: killed
            out.state, out.error = "failed", "the captioning process ended without a record"
        return
    code = record.get("exit_code")
    if code == 130 or record.get("signal"):
        out.state = "stopped"
    elif code:
        out.state = "failed"
        errors = [ln for ln in lines if ln.startswith(("error:", "internal error"))]
        out.error = errors[-1] if errors else (lines[-1] if lines else f"exit code {code}")


def _speed(files: dict[str, Path], out: CaptionStatus) -> None:
    """Images a second since the start, and the time left at that speed."""
    began = _started(files)
    if out.done and out.state == "running" and began:
        out.rate = out.done / max(time.time() - began, 1e-6)
        if out.total is not None:
            out.eta_s = max(out.total - out.done, 0) / out.rate


def findings(source: Path, resolution: int, roots: "Roots") -> "Report":
    """The dataset report of a folder (at `resolution`) or of a run file's datasets.
    PathOutsideRoots for a path the run file names outside `roots` (checked before it loads:
    loading reads model files' headers) and for a dataset folder or a file in one (links
    followed) outside them: the report reads every image and caption."""
    from difftune.dataset_report.checks import Settings
    from difftune.ui.datasets import check_sources, folder_datasets
    from difftune.ui.jobs.paths import load_checked
    from difftune.verbs.dataset_report import config_report, folder_report

    if source.is_file():
        cfg = load_checked(source, roots)
        check_sources(cfg.datasets, roots)
        return config_report(cfg, Settings())
    check_sources(folder_datasets(source, resolution), roots)
    return folder_report(source, Settings(), resolution)


def captioners_under(roots: list[Path], depth: int = 4, limit: int = 100) -> list[dict[str, str]]:
    """The captioning models under `roots` (down to `depth` levels): each folder `detect`
    takes, with its kind, for the page's model picker. A model's own folder is not searched
    further; hidden, linked and cache folders are left out (as the dataset picker does)."""
    from difftune.caption.detect import detect
    from difftune.errors import DifftuneError
    from difftune.ui.runs import searched

    found: list[dict[str, str]] = []

    def walk(folder: Path, left: int) -> None:
        if len(found) >= limit:
            return
        if any((folder / f).is_file() for f in MODEL_FILES):
            try:
                found.append({"path": str(folder), "kind": detect(folder).kind})
                return
            except DifftuneError:
                pass  # a model folder, not a captioner's: its subfolders may hold one
        try:
            children = sorted(c for c in folder.iterdir() if c.is_dir())
        except OSError:
            return
        for child in children if left > 0 else []:
            if searched(child):
                walk(child, left - 1)

    for root in roots:
        walk(Path(root), depth)
    return found
