"""The job queue: submit, stop, resume, duplicate and requeue CLI jobs; one at a time per device.

Jobs are rows in SQLite (store.py) and processes (launch.py); `tick` derives every unfinished
job from its process and files (derive.py) and starts the oldest queued job of each device
with nothing running. A daemon thread ticks twice a second. Closing the queue never stops a
job, and a new queue on the same database (the app restarted) re-attaches to the jobs whose
wrappers live and finishes the others from their exit records.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from difftune.errors import ConfigError
from difftune.ui.jobs import cluster, rules
from difftune.ui.jobs.clone import clone
from difftune.ui.jobs.derive import derive, tail_lines, wrapper_alive
from difftune.ui.jobs.launch import (cli_argv, device_env, gpus_visible, parse_device,
                                      resolve_device, start_wrapper)
from difftune.ui.jobs.paths import check_run_file, checked_args
from difftune.ui.jobs.store import LIVE, VERBS, Job, JobStore
from difftune.ui.limits import TooLarge
from difftune.ui.security import Roots

TICK_SECONDS = 0.5

log = logging.getLogger("difftune")


class JobStateError(ValueError):
    """An action the job's state does not allow (stop a finished job, resume without a
    checkpoint, requeue a running one)."""


class JobQueue:
    """Jobs persisted in `db`; run files and run folders must lie under `roots`.

    `python` runs the wrapper and the CLI. `command` (for tests and tools) replaces the CLI
    command a job runs: it receives the job and returns the argv to start. `gpus` says
    whether the machine has a GPU for jobs (default: whether torch sees one), which decides
    what "default" and "cuda:N" resolve to."""

    def __init__(self, db: Path, roots: Roots, python: str = sys.executable, *,
                 command: Callable[[Job], list[str]] | None = None,
                 gpus: bool | None = None) -> None:
        self.roots = roots
        self.python = python
        self._gpus = gpus
        self.store = JobStore(db)
        self._command = command or (lambda job: cluster.argv(job, python)
                                    if cluster.is_slurm(job.device)
                                    else cli_argv(job.verb, job.config, job.args, python))
        self._lock = threading.RLock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        with self._lock:  # after a restart: never leave a job "running" without its process
            for job in self.store.all():
                self._refresh(job)
        report = self.store.unreadable_report()
        if report is not None:
            log.warning(report)

    def submit(self, verb: str, config: str | Path, args: Iterable[str] = (),
               device: str = "default", *, parent: int | None = None) -> Job:
        """Queue `difftune <verb> <config> <args...>` on `device`. The run file must lie under
        the roots (PathOutsideRoots otherwise); the run folder is its `[save] dir`."""
        if verb not in VERBS:
            raise ValueError(f"verb {verb!r} is not a job this app runs; use one of "
                             f"{', '.join(VERBS)}")
        device = parse_device(device)  # raises on an unknown device
        if cluster.is_slurm(device) and verb != "train":
            raise ValueError(f"device {device}: only train jobs go to the SLURM cluster; run "
                             f"{verb} on this machine (default, cpu or cuda:N)")
        path = self.roots.resolve(config)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist; pass the path of a .toml run "
                             "file")
        checked = checked_args(list(args), self.roots)
        check_run_file(path, checked, self.roots)  # save.dir outside: refused naming it
        run_dir = self.roots.resolve(run_dir_of(path, checked), write=True)
        with self._lock:
            if verb == "train":
                _refuse(rules.training_refusal(run_dir, path, checked, self.unfinished()))
            return self.store.add(verb, path, checked, run_dir, device, parent)

    def unfinished(self) -> list[Job]:
        """The queued, running and stopping jobs, as last derived (not derived again: cheap
        enough to ask on every refresh of a page)."""
        with self._lock:
            return [job for job in self.store.all() if not job.finished]

    def run_dirs(self) -> set[Path]:
        """The run folder of every job, finished or not (a new run's folder is none of
        them)."""
        with self._lock:
            return {Path(job.run_dir) for job in self.store.all()}

    def list(self) -> list[Job]:
        """Every job, newest first, each derived from its process and run folder."""
        with self._lock:
            return [self._refresh(job) for job in reversed(self.store.all())]

    def get(self, job_id: int) -> Job:
        """The job `job_id`, derived now; KeyError if there is none."""
        with self._lock:
            return self._refresh(self.store.get(job_id))

    def stop(self, job_id: int) -> Job:
        """Cancel a queued job, or ask a running one to stop (SIGTERM: a training saves a
        checkpoint and exits). Stop on a job already stopping kills it (SIGKILL to its whole
        process group: a process that ignores or hangs on SIGTERM must not stay "stopping"
        forever); it then shows as died. JobStateError for a job that has ended."""
        with self._lock:
            job = self.get(job_id)
            if job.state == "queued":
                return self._save(replace(job, state="cancelled", ended=time.time()))
            if job.state == "stopping":
                if job.pid is not None and wrapper_alive(job):
                    try:
                        os.killpg(job.pid, signal.SIGKILL)  # the wrapper leads its session
                    except ProcessLookupError:
                        pass
                return job
            if job.state != "running":
                raise JobStateError(f"job {job_id} has already ended ({job.state}); there is "
                                 "nothing to stop")
            if cluster.is_slurm(job.device) and cluster.cancel(job, self.tail(job_id, 50)):
                return self._save(replace(job, state="stopping"))  # SLURM ends it
            if job.pid is not None and wrapper_alive(job):
                try:
                    os.kill(job.pid, signal.SIGTERM)  # the wrapper passes it on to the CLI
                except ProcessLookupError:
                    return self.get(job_id)
            return self._save(replace(job, state="stopping"))

    def resume(self, job_id: int) -> Job:
        """A new queued train job continuing this one's run (`--resume latest`). JobStateError
        unless it is a finished train job whose run is not complete and whose run folder has
        a complete checkpoint."""
        with self._lock:
            job = self.get(job_id)
            _refuse(rules.resume_refusal(job, self.roots))
            args = [*without_options(job.args, ("--resume", "--init-lora")), "--resume", "latest"]
            return self.submit("train", job.config, args, job.device, parent=job.id)

    def duplicate(self, job_id: int) -> Job:
        """A new queued copy of the job. A training's copy trains into a new run folder under
        a new name, from a copy of its run file written beside it (clone.py): rerun in its
        own folder it would fail on the results there. Other jobs are queued again as they
        are (same verb, run file, arguments and device)."""
        with self._lock:
            job = self.store.get(job_id)
            _refuse(rules.duplicate_refusal(job))
            config, args = Path(job.config), job.args
            if job.verb == "train":
                try:
                    config, args = clone(config, args, Path(job.run_dir), self.roots,
                                         self.run_dirs())
                except TooLarge:
                    raise
                except ConfigError as err:
                    raise ValueError(f"cannot copy the run file {job.config}: {err}") from None
            return self.submit(job.verb, config, args, job.device, parent=job.id)

    def requeue(self, job_id: int) -> Job:
        """A finished job queued again, as a new job. JobStateError while it is unfinished,
        and for a training whose run folder now holds results (duplicate it instead)."""
        with self._lock:
            job = self.get(job_id)
            _refuse(rules.requeue_refusal(job, self.unfinished()))
            return self.submit(job.verb, job.config, job.args, job.device, parent=job.id)

    def log_path(self, job_id: int) -> Path:
        """The job's log file (the CLI's output)."""
        return self.store.get(job_id).log

    def tail(self, job_id: int, lines: int = 200) -> list[str]:
        """The last `lines` lines of the job's log ([] before it has started)."""
        return tail_lines(self.log_path(job_id), lines)

    def tick(self) -> None:
        """Derive every unfinished job; start the oldest queued job of each device that has
        nothing running (one job at a time per device, in submission order)."""
        with self._lock:
            for pid, proc in list(self._children.items()):
                if proc.poll() is not None:  # reap: a finished wrapper is not left a zombie
                    del self._children[pid]
            jobs = [self._refresh(job) if job.state in LIVE else job for job in self.store.all()]
            busy = {self.device_of(job) for job in jobs if job.state in LIVE}
            for job in jobs:
                device = self.device_of(job)
                if job.state == "queued" and device not in busy:
                    busy.add(device)
                    self._launch(job)

    def device_of(self, job: Job) -> str:
        """The device `job` runs on, as `resolve_device` names it (its device as stored when
        that is not one: it then fails to start, saying why)."""
        if cluster.is_slurm(job.device):
            return f"slurm#{job.id}"  # SLURM queues its jobs itself: none waits here
        gpus = gpus_visible() if self._gpus is None else self._gpus
        try:
            return resolve_device(job.device, gpus)
        except ValueError:
            return job.device

    def start(self) -> None:
        """Tick in a daemon thread every half second, until `close`."""
        if self._thread is not None:
            return
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name="difftune-jobs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop ticking and close the database; running jobs go on (a new queue re-attaches)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self.store.close()

    def _loop(self) -> None:
        """The ticking thread: a failed tick is retried on the next one, never fatal."""
        while not self._halt.wait(TICK_SECONDS):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep the queue alive; the next tick retries
                log.exception("job queue tick failed")

    def _launch(self, job: Job) -> None:
        """Start `job`'s wrapper; a job that cannot start fails with the reason (its run
        file is checked again: it may have been edited to name a path outside the roots
        since the job was queued)."""
        try:
            check_run_file(job.config, job.args, self.roots)
            proc = start_wrapper(self.python, self._command(job), job.log, job.record,
                                 job.pidfile, job.run_dir, device_env(job.device))
        except (OSError, ValueError) as err:  # (PathOutsideRoots is a ValueError)
            self._save(replace(job, state="failed", ended=time.time(),
                               error=f"the job could not start: {err}"))
            return
        self._children[proc.pid] = proc
        self._save(replace(job, state="running", pid=proc.pid, started=time.time()))

    def _refresh(self, job: Job) -> Job:
        """`job` derived from its process and files; stored when its state changed."""
        new = derive(job)
        if (new.state, new.exit_code, new.error, new.ended) != \
                (job.state, job.exit_code, job.error, job.ended):
            self.store.save(new)
        return new

    def _save(self, job: Job) -> Job:
        """Store `job` and return it."""
        self.store.save(job)
        return job


def run_dir_of(config: Path, args: list[str]) -> Path:
    """The job's run folder: the run file's `[save] dir` (after its `--set` overrides) taken
    relative to the run file's folder, as the CLI does; that folder when it cannot be read.
    TooLarge for a file larger than a run file can be (it is not read)."""
    folder = rules.save_table(config, args).get("dir")
    if not isinstance(folder, str) or not folder.strip():
        return config.parent
    path = Path(folder).expanduser()
    return (path if path.is_absolute() else config.parent / path).resolve()


def _refuse(reason: str | None) -> None:
    """Raise JobStateError with `reason`, when there is one."""
    if reason is not None:
        raise JobStateError(reason)


def without_options(args: list[str], options: tuple[str, ...]) -> list[str]:
    """`args` without the given options and their values."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(o + "=" for o in options)):
            out.append(arg)
    return out
