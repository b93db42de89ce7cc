"""The job table: one SQLite file (WAL) that survives a restart of the app.

The table holds what was asked (verb, run file, arguments, device) and the last state derived
from the job's process and files; the truth stays in the run folder (`.difftune-jobs/<id>.*`,
see launch.py), so a row is only a cache that `derive` corrects.

A database that cannot serve (damaged, truncated, not difftune's, read-only) is refused when
opened, before anything is written to it (JobDatabaseError, naming the file and the fix); a
row that cannot be read is left out of the list and reported (`unreadable`), never guessed at.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from difftune.errors import DifftuneError

VERBS = ("train", "check", "cache", "sample")
# A job in one of these has a process (or is about to get one); the others are final.
LIVE = ("running", "stopping")
FINISHED = ("succeeded", "failed", "stopped", "cancelled", "died")
STATES = ("queued", *LIVE, *FINISHED)
JOBS_FOLDER = ".difftune-jobs"  # the job's files, inside its run folder

_COLUMNS = ("verb", "config", "args", "run_dir", "device", "state", "pid", "exit_code", "error",
            "created", "started", "ended", "log", "parent")
_NUMBERS = ("pid", "exit_code", "created", "started", "ended", "parent")
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
    scheduler: str | None = None  # a SLURM job's state as SLURM says it (ui/jobs/cluster.py)

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


class JobDatabaseError(DifftuneError):
    """The job database cannot be used as it is; the message names it and what to do."""


class JobStore:
    """The jobs table in the SQLite file `path`; safe to use from several threads.
    `unreadable`: the rows that could not be read (id: why), as last listed."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.unreadable: dict[int, str] = {}
        self._lock = threading.Lock()
        self._db = _open(path)

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
        try:
            return _job(row)
        except ValueError as err:
            raise KeyError(f"job {job_id}'s row in the job database {self.path} cannot be "
                           f"read: {err}") from None

    def all(self) -> list[Job]:
        """Every job that can be read, oldest first; the others go to `unreadable`."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT id, {', '.join(_COLUMNS)} FROM jobs ORDER BY id").fetchall()
        jobs, unreadable = [], {}
        for row in rows:
            try:
                jobs.append(_job(row))
            except ValueError as err:
                unreadable[int(row[0])] = str(err)
        self.unreadable = unreadable
        return jobs

    def unreadable_report(self) -> str | None:
        """What to tell a user about the rows `all` left out (None when there were none)."""
        if not self.unreadable:
            return None
        rows = "; ".join(f"job {i}: {why}" for i, why in sorted(self.unreadable.items()))
        return (f"{len(self.unreadable)} job(s) in the job database {self.path} cannot be read "
                f"and are not listed ({rows}). Their runs stay in their folders; to drop the rows "
                f"from the list for good: sqlite3 {self.path} 'DELETE FROM jobs WHERE id IN "
                f"({', '.join(map(str, sorted(self.unreadable)))})'")

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
    """A Job from a `SELECT id, <_COLUMNS>` row; ValueError saying which column is wrong."""
    values = dict(zip(("id", *_COLUMNS), row))
    try:
        values["args"] = json.loads(values["args"])
    except (TypeError, ValueError):
        raise ValueError(f"args is not a JSON list ({values['args']!r:.60})") from None
    if not isinstance(values["args"], list) or not all(isinstance(a, str)
                                                       for a in values["args"]):
        raise ValueError(f"args is not a list of strings ({values['args']!r:.60})")
    for key in ("verb", "config", "run_dir", "device", "state", "log"):
        if not isinstance(values[key], str):
            raise ValueError(f"{key} is not text ({values[key]!r:.60})")
    if values["verb"] not in VERBS or values["state"] not in STATES:
        raise ValueError(f"verb {values['verb']!r:.30} or state {values['state']!r:.30} is not "
                         "one this app knows")
    for key in _NUMBERS:
        if values[key] is not None and not isinstance(values[key], (int, float)):
            raise ValueError(f"{key} is not a number ({values[key]!r:.60})")
    for key in ("config", "run_dir", "log"):
        values[key] = Path(values[key])
    return Job(**values)


def _open(path: Path) -> sqlite3.Connection:
    """A connection to the job database at `path` (made when missing), checked before
    anything is written to it: JobDatabaseError when it cannot serve as the job database."""
    if path.exists():
        if not os.access(path, os.R_OK | os.W_OK) or not os.access(path.parent, os.W_OK):
            raise JobDatabaseError(
                f"the job database {path} is read-only for this user (it, or its folder "
                f"{path.parent}); make both writable (chmod u+rw), or start `difftune ui` as "
                "the user that owns them")
        if path.stat().st_size == 0:
            _unusable(path, "is empty (0 bytes): it was truncated, and its jobs are gone")
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    except sqlite3.Error as err:
        _unusable(path, f"cannot be opened (SQLite: {err})")
    try:
        problem = _problem(db)
        if problem is None:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)
    except sqlite3.Error as err:
        problem = f"cannot be read (SQLite: {err})"
    if problem is not None:
        db.close()
        _unusable(path, problem)
    return db


def _problem(db: sqlite3.Connection) -> str | None:
    """What makes the open database unfit to hold the jobs table (damaged, or holding other
    tables than difftune's), or None. Reads only."""
    check = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
    if check != ["ok"]:
        return f"is damaged (SQLite's quick_check: {'; '.join(map(str, check))[:300]})"
    tables = {row[0] for row in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
    if not tables:
        return None  # new: the table is made
    if "jobs" not in tables:
        return (f"is not a difftune job database (it holds the tables {', '.join(sorted(tables))}"
                ", and no jobs table)")
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    missing = [c for c in ("id", *_COLUMNS) if c not in columns]
    if missing:
        return (f"holds a jobs table of another schema (no column {', '.join(missing)}): it is "
                "not this version's job database")
    return None


def _unusable(path: Path, problem: str) -> NoReturn:
    """Raise JobDatabaseError: the database at `path` `problem`, and what to do (it is left
    as it is)."""
    raise JobDatabaseError(
        f"the job database {path} {problem}. It is left as it is. Move it aside (mv {path} "
        f"{path}.bad) and start `difftune ui` again for an empty job list: the runs stay in "
        "their folders, and their files remain")
