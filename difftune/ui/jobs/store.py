"""The job table: one SQLite file (WAL) that survives a restart of the app.

The table holds what was asked (verb, run file, arguments, device) and the last state derived
from the job's process and files; the truth stays in the run folder (`.difftune-jobs/<id>.*`,
see launch.py), so a row is only a cache that `derive` corrects.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

VERBS = ("train", "check", "cache", "sample")
# A job in one of these has a process (or is about to get one); the others are final.
LIVE = ("running", "stopping")
FINISHED = ("succeeded", "failed", "stopped", "cancelled", "died")
STATES = ("queued", *LIVE, *FINISHED)
JOBS_FOLDER = ".difftune-jobs"  # the job's files, inside its run folder

_COLUMNS = ("verb", "config", "args", "run_dir", "device", "state", "pid", "exit_code", "error",
            "created", "started", "ended", "log", "parent")
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, {", ".join(_COLUMNS)})"""


@dataclass
class Job:
    """One queued, running or finished CLI invocation.

    `checkpoints` (folder names under `<run_dir>/checkpoints/`) and `loras` (LoRA files in the
    run folder) are read from disk by `derive`; they are not stored."""

    id: int
    verb: str
    config: Path
    args: list[str]
    run_dir: Path
    device: str = "default"
    state: str = "queued"
    pid: int | None = None
    exit_code: int | None = None
    error: str | None = None
    created: float | None = None
    started: float | None = None
    ended: float | None = None
    log: Path = Path()
    parent: int | None = None
    checkpoints: list[str] = field(default_factory=list)
    loras: list[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        """The job's files: log, pid file and exit record (`<run_dir>/.difftune-jobs`)."""
        return self.run_dir / JOBS_FOLDER

    @property
    def record(self) -> Path:
        """The exit record the wrapper writes when the CLI ends (`<id>.exit.json`)."""
        return self.folder / f"{self.id}.exit.json"

    @property
    def pidfile(self) -> Path:
        """The wrapper's pid and start time (`<id>.pid.json`), written when it starts."""
        return self.folder / f"{self.id}.pid.json"

    @property
    def finished(self) -> bool:
        """Whether the job is in a final state."""
        return self.state in FINISHED

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON-friendly values (paths as strings)."""
        out = asdict(self)
        for key in ("config", "run_dir", "log"):
            out[key] = str(out[key])
        return out


class JobStore:
    """The jobs table in the SQLite file `path`; safe to use from several threads."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def add(self, verb: str, config: Path, args: list[str], run_dir: Path, device: str,
            parent: int | None = None) -> Job:
        """A new queued job; its log is `<run_dir>/.difftune-jobs/<id>.log`."""
        job = Job(id=0, verb=verb, config=config, args=list(args), run_dir=run_dir,
                  device=device, created=time.time(), parent=parent)
        with self._lock:
            cursor = self._db.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES "
                f"({', '.join('?' * len(_COLUMNS))})", _row(job))
            job = replace(job, id=int(cursor.lastrowid or 0))
            job.log = job.folder / f"{job.id}.log"
            self._db.execute("UPDATE jobs SET log = ? WHERE id = ?", (str(job.log), job.id))
        return job

    def save(self, job: Job) -> None:
        """Write every stored field of `job` back to its row."""
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {', '.join(c + ' = ?' for c in _COLUMNS)} "
                             "WHERE id = ?", (*_row(job), job.id))

    def get(self, job_id: int) -> Job:
        """The job with this id; KeyError if there is none."""
        with self._lock:
            row = self._db.execute(f"SELECT id, {', '.join(_COLUMNS)} FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()
        if row is None:
            raise KeyError(f"no job {job_id}: list the jobs to see their ids")
        return _job(row)

    def all(self) -> list[Job]:
        """Every job, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT id, {', '.join(_COLUMNS)} FROM jobs ORDER BY id").fetchall()
        return [_job(row) for row in rows]

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()


def _row(job: Job) -> tuple[Any, ...]:
    """The stored columns of `job`, in `_COLUMNS` order."""
    return (job.verb, str(job.config), json.dumps(job.args), str(job.run_dir), job.device,
            job.state, job.pid, job.exit_code, job.error, job.created, job.started, job.ended,
            str(job.log), job.parent)


def _job(row: tuple[Any, ...]) -> Job:
    """A Job from a `SELECT id, <_COLUMNS>` row."""
    values = dict(zip(("id", *_COLUMNS), row))
    values["args"] = json.loads(values["args"])
    for key in ("config", "run_dir", "log"):
        values[key] = Path(values[key])
    return Job(**values)
