"""/api/jobs: submit, list, watch and act on jobs (the same queue calls the pages make).

Errors, each with the queue's message: a path outside the roots -> 403; an unknown job ->
404; an action the job's state refuses (resume without a checkpoint or of a complete run,
stop of a finished job, a new training in a run folder that holds results or that another
training uses) -> 409; bad input (a missing run file, an unknown device) -> 400; a run file
larger than a run file can be -> 413.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, TypeVar

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from difftune.ui.jobs import rules
from difftune.ui.jobs.progress import progress
from difftune.ui.jobs.queue import JobStateError
from difftune.ui.jobs.store import Job
from difftune.ui.limits import TooLarge
from difftune.ui.security import PathOutsideRoots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext
    from difftune.ui.jobs.queue import JobQueue


T = TypeVar("T")


class JobIn(BaseModel):
    """A job to queue: `difftune <verb> <config> <args...>` on a device."""

    verb: Literal["train", "check", "cache", "sample"] = Field(description="the CLI verb")
    config: str = Field(description="the run file (.toml), absolute or relative to the first "
                        "root; it must lie under the roots")
    args: list[str] = Field(default=[], description='extra CLI arguments, e.g. ["--set", '
                            '"train.lr=2e-4"]; paths they name must lie under the roots')
    device: str = Field(default="default", description="default, cpu or cuda:N; one job at a "
                        "time runs per device; slurm:NxG[@PARTITION] submits a training to "
                        "SLURM (N nodes, G GPUs each)")


class ProgressOut(BaseModel):
    """A training's progress as its run folder says (see `difftune.ui.jobs.progress`)."""

    name: str
    step: int
    total: int | None
    eta_s: float | None = Field(description="seconds left at the logged speed")
    loss: float | None = Field(description="the last logged loss (smoothed when logged so)")
    sample: str | None = Field(description="the newest sample image (GET /api/runs/image)")
    finished: bool


class JobOut(BaseModel):
    """A job as its process and run folder say it is."""

    id: int
    verb: str
    config: str
    args: list[str]
    run_dir: str = Field(description="the run folder (the run file's save.dir)")
    device: str
    state: Literal["queued", "running", "stopping", "succeeded", "failed", "stopped",
                   "cancelled", "died"]
    pid: int | None = Field(description="the wrapper process's id while it runs")
    exit_code: int | None
    error: str | None = Field(description="the CLI's own error message when the job failed")
    created: float | None
    started: float | None
    ended: float | None
    log: str = Field(description="the job's log file")
    parent: int | None = Field(description="the job this one resumes, duplicates or requeues")
    checkpoints: list[str] = Field(description="complete checkpoints in the run folder")
    scheduler: str | None = Field(description="a SLURM job's state as SLURM says it "
                                  "(pending, running, requeued, the reason it failed)")
    loras: list[str] = Field(description="LoRA files in the run folder")
    name: str = Field(description="the run's name: its run folder's name")
    progress: ProgressOut | None = Field(description="a training's progress, from its run "
                                         "folder (null for other verbs)")
    actions: dict[str, str | None] = Field(description="the actions that make sense now "
                                           "(stop, kill, resume, requeue, duplicate): null "
                                           "when the action can be taken, else why not (the "
                                           "action itself answers 409 with that reason)")

    @classmethod
    def of(cls, job: Job, queue: "JobQueue", unfinished: list[Job] | None = None) -> "JobOut":
        """The response for `job`, with its progress and the actions it offers (`unfinished`:
        the queue's unfinished jobs, when the caller has them)."""
        run = progress(job.run_dir, queue.roots) if job.verb == "train" else None
        if unfinished is None:
            unfinished = queue.unfinished()
        return cls(**job.to_dict(), name=Path(job.run_dir).name,
                   progress=ProgressOut(**run.to_dict()) if run is not None else None,
                   actions=rules.offers(job, unfinished, queue.roots))


class LogOut(BaseModel):
    """The end of a job's log."""

    id: int
    lines: list[str]


def router(ctx: "UiContext") -> APIRouter:
    """The /jobs routes over `ctx.queue`."""
    api = APIRouter(prefix="/jobs", tags=["jobs"])
    queue = ctx.queue

    @api.post("", response_model=JobOut, status_code=201, summary="Queue a job")
    def submit(body: JobIn) -> JobOut:
        """Queue a CLI job; it starts when its device has nothing running."""
        return JobOut.of(_answer(lambda: queue.submit(body.verb, body.config, body.args,
                                                      body.device)), queue)

    @api.get("", response_model=list[JobOut], summary="List jobs")
    def list_jobs() -> list[JobOut]:
        """Every job, newest first, derived now from its process and run folder."""
        jobs = queue.list()
        unfinished = [job for job in jobs if not job.finished]
        return [JobOut.of(job, queue, unfinished) for job in jobs]

    @api.get("/{job_id}", response_model=JobOut, summary="One job")
    def get(job_id: int) -> JobOut:
        """The job's state, exit code, error, checkpoints and LoRA files."""
        return JobOut.of(_answer(lambda: queue.get(job_id)), queue)

    @api.post("/{job_id}/stop", response_model=JobOut, summary="Stop a job")
    def stop(job_id: int) -> JobOut:
        """Cancel a queued job, or send SIGTERM to a running one (a training saves a
        checkpoint, then exits: its state becomes stopped)."""
        return JobOut.of(_answer(lambda: queue.stop(job_id)), queue)

    @api.post("/{job_id}/resume", response_model=JobOut, status_code=201,
              summary="Resume a train job")
    def resume(job_id: int) -> JobOut:
        """Queue a train job continuing this one from its run's latest checkpoint (409 for a
        complete run, or one without a checkpoint)."""
        return JobOut.of(_answer(lambda: queue.resume(job_id)), queue)

    @api.post("/{job_id}/duplicate", response_model=JobOut, status_code=201,
              summary="Duplicate a job")
    def duplicate(job_id: int) -> JobOut:
        """Queue a copy of the job. A training's copy trains into a new run folder under a
        new name: a copy of its run file, written beside it, with save.dir and save.name
        changed (nothing is overwritten); other jobs are queued again as they are."""
        return JobOut.of(_answer(lambda: queue.duplicate(job_id)), queue)

    @api.post("/{job_id}/requeue", response_model=JobOut, status_code=201,
              summary="Requeue a finished job")
    def requeue(job_id: int) -> JobOut:
        """Queue a finished job again, as a new job (409 for a training whose run folder
        holds its results: resume or duplicate it)."""
        return JobOut.of(_answer(lambda: queue.requeue(job_id)), queue)

    @api.get("/{job_id}/log", response_model=LogOut, summary="The end of a job's log")
    def log(job_id: int, tail: int = Query(200, ge=1, le=100_000,
                                           description="how many lines")) -> LogOut:
        """The last `tail` lines of the job's log (the CLI's output)."""
        return LogOut(id=job_id, lines=_answer(lambda: queue.tail(job_id, tail)))

    return api


def _answer(call: Callable[[], T]) -> T:
    """`call()`, its refusals turned into HTTP errors with the queue's message."""
    try:
        return call()
    except PathOutsideRoots as err:
        raise HTTPException(403, str(err)) from None
    except TooLarge as err:
        raise HTTPException(413, str(err)) from None
    except KeyError as err:
        raise HTTPException(404, err.args[0] if err.args else "no such job") from None
    except JobStateError as err:
        raise HTTPException(409, str(err)) from None
    except ValueError as err:
        raise HTTPException(400, str(err)) from None
