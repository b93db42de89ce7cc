"""What each action on a job needs, said before it is tried: the pages show an action only
when it can work (or disabled, with the reason these functions give), and the queue refuses
the same actions with the same reasons (the API answers 409).

A new training never goes into a run folder that another unfinished training uses, nor into
one that holds a run's results (the CLI would refuse it: `difftune.train.rundir`), unless it
resumes that run or sets `save.overwrite`. A run that is complete has nothing to resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from difftune.train.rundir import outputs_in
from difftune.ui.jobs.paths import option_values, raw_run_file
from difftune.ui.jobs.progress import progress
from difftune.ui.jobs.store import Job
from difftune.ui.security import Roots

# The actions a job may offer, in the order the pages show them.
ACTIONS = ("stop", "kill", "resume", "requeue", "duplicate")


def save_table(config: Path, args: list[str]) -> dict[str, Any]:
    """The run file's `[save]` table after the job's `--set` overrides ({} when the file
    cannot be read as TOML: the CLI reports that). TooLarge for a file larger than a run
    file can be (it is not read)."""
    data = raw_run_file(config, option_values(args, "--set")) or {}
    save = data.get("save")
    return save if isinstance(save, dict) else {}


def resumes(args: list[str]) -> bool:
    """Whether the arguments continue an existing run (`--resume`)."""
    return any(a == "--resume" or a.startswith("--resume=") for a in args)


def training_refusal(run_dir: Path, config: Path, args: list[str],
                     unfinished: Iterable[Job]) -> str | None:
    """Why a train job with `args` cannot start in `run_dir` now, or None: another queued or
    running training uses the folder, or (for a new run) the folder holds a run's results."""
    for other in unfinished:
        if other.verb == "train" and Path(other.run_dir) == run_dir:
            return (f"job {other.id} ({other.state}) already trains in the run folder "
                    f"{run_dir}; wait for it to end, or Duplicate it to train a copy in a new "
                    "folder")
    if resumes(args) or save_table(config, args).get("overwrite") is True:
        return None
    found = next(outputs_in(run_dir), None)
    if found is not None:
        return (f"the run folder {run_dir} already holds a run's results ({found}); Resume "
                "that run, or Duplicate it to train a copy in a new folder (difftune never "
                "overwrites what a run made)")
    return None


def resume_refusal(job: Job, roots: Roots) -> str | None:
    """Why `job` cannot be resumed (`--resume latest` in its run folder), or None."""
    if job.verb != "train":
        return f"job {job.id} is a {job.verb} job; only a train job can be resumed"
    if not job.finished:
        return f"job {job.id} is {job.state}; stop it, or wait for it to end, before resuming"
    run = progress(job.run_dir, roots)  # cached: asked for every job on every refresh
    if job.state == "succeeded" or run.finished:
        done = f"step {run.step} of {run.total}" if run.total else "its final file written"
        return (f"job {job.id}'s run is complete ({done}): there is nothing left to train; "
                "Duplicate it to train again in a new folder")
    if not job.checkpoints:
        return (f"job {job.id} cannot be resumed: its run folder {job.run_dir} has no "
                "complete checkpoint (checkpoints/step-*/ with state.json); Duplicate it to "
                "start the run over in a new folder")
    return None


def requeue_refusal(job: Job, unfinished: Iterable[Job]) -> str | None:
    """Why `job` cannot be queued again as it is, or None."""
    if not job.finished:
        return (f"job {job.id} is {job.state}; only a finished job can be requeued "
                "(Duplicate queues a copy of any job)")
    if job.verb == "train":
        return training_refusal(job.run_dir, job.config, job.args, unfinished)
    return None


def duplicate_refusal(job: Job) -> str | None:
    """Why `job` cannot be copied, or None (a training's copy needs its run file)."""
    if job.verb == "train" and not Path(job.config).is_file():
        return (f"job {job.id}'s run file {job.config} is gone; a copy of the run is made from "
                "it")
    return None


def offers(job: Job, unfinished: list[Job], roots: Roots) -> dict[str, str | None]:
    """The actions that make sense for `job` now, each with None when it can be taken or
    the reason it cannot (shown beside the disabled button)."""
    out: dict[str, str | None] = {}
    if job.state in ("queued", "running"):
        out["stop"] = None
    if job.state == "stopping":  # it did not stop on SIGTERM: a second press kills it
        out["kill"] = None
    if job.finished and job.verb == "train":
        out["resume"] = resume_refusal(job, roots)
    if job.finished:
        out["requeue"] = requeue_refusal(job, unfinished)
    out["duplicate"] = duplicate_refusal(job)
    return out
