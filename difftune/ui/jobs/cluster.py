"""Jobs the queue hands to a SLURM cluster instead of running them on this machine.

A job's device `slurm`, `slurm:NxG` or `slurm:NxG@PARTITION` (N nodes, G GPUs each, G = 0 for
CPU nodes; `slurm` is `slurm:1x1`) runs `difftune slurm submit` through the usual wrapper; the
job then lives in SLURM, which queues it (SLURM jobs never wait on each other here). Its state is
SLURM's, read when the queue derives it (`scontrol`, see cluster/slurm.py): pending, running,
requeued and running again are the queue's "running", with SLURM's own line (`scheduler`:
"job 12: PENDING (Resources)", "... (BeginTime, requeued 1 time(s))"); COMPLETED is
"succeeded", CANCELLED "stopped", any other end "failed" with SLURM's reason. The run page is
the same as for a local job: it reads the run folder, which the cluster's nodes write.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any

from difftune.cluster import slurm
from difftune.ui.jobs.store import Job

DEVICE = re.compile(r"slurm(?::([0-9]+)x([0-9]+))?(?:@([A-Za-z0-9_.-]+))?")
SUBMITTED = re.compile(r"^submitted job (\S+) ")  # what `difftune slurm submit` prints
ASK_SECONDS = 2.0
_asked: dict[str, tuple[float, slurm.JobState]] = {}  # job id -> (when, what SLURM said)


def is_slurm(device: str) -> bool:
    """Whether `device` names the cluster."""
    return DEVICE.fullmatch(device) is not None


def parse(device: str) -> str:
    """A SLURM device in its one spelling (`slurm:NxG[@P]`); ValueError for a bad one."""
    found = DEVICE.fullmatch(device)
    if found is None:
        raise ValueError(f"device {device!r} is not a SLURM device; use slurm, slurm:NxG or "
                         "slurm:NxG@PARTITION (N nodes, G GPUs per node, 0 for CPU nodes)")
    nodes, gpus, partition = found.groups()
    nodes, gpus = int(nodes or 1), int(gpus if gpus is not None else 1)
    if nodes < 1:
        raise ValueError(f"device {device!r}: a SLURM job needs 1 node or more")
    return f"slurm:{nodes}x{gpus}" + (f"@{partition}" if partition else "")


def argv(job: Job, python: str) -> list[str]:
    """The command that submits `job` (a training) to SLURM."""
    nodes, gpus, partition = DEVICE.fullmatch(parse(job.device)).groups()  # type: ignore[union-attr]
    args: list[str] = []
    resume = skip = False
    for arg in job.args:
        if skip:
            skip = False
        elif arg == "--resume":  # the script resumes the latest checkpoint by itself
            resume, skip = True, True
        elif arg != "--no-progress":
            args.append(arg)
    return [python, "-m", "difftune", "slurm", "submit", str(job.config), "--nodes", nodes,
            "--gpus-per-node", gpus, *(["--partition", partition] if partition else []),
            *(["--resume"] if resume else []), *args]


def slurm_id(job: Job, lines: list[str]) -> str | None:
    """The SLURM job id `difftune slurm submit` printed into the job's log (`lines`)."""
    for line in lines:
        found = SUBMITTED.match(line)
        if found:
            return found.group(1)
    return None


def follow(job: Job, record: dict[str, Any], lines: list[str]) -> Job | None:
    """`job` as SLURM says it is, once its submission succeeded (`record`: the wrapper's exit
    record; `lines`: its log); None where the submission did not (derive's usual rules)."""
    job_id = slurm_id(job, lines)
    if int(record.get("exit_code", 1)) != 0 or job_id is None:
        return None
    try:
        seen = _state(job_id)
    except Exception as err:  # noqa: BLE001 - a controller that does not answer: try later
        return replace(job, scheduler=f"job {job_id}: SLURM did not answer ({err})")
    job = replace(job, scheduler=seen.describe())
    if not seen.finished:
        return job
    ended = job.ended or time.time()
    if seen.state == "COMPLETED":
        return replace(job, state="succeeded", exit_code=0, ended=ended, error=None)
    if seen.state == "CANCELLED":
        return replace(job, state="stopped", ended=ended, error=None)
    return replace(job, state="failed", ended=ended, error=f"SLURM: {seen.describe()}")


def _state(job_id: str) -> slurm.JobState:
    """SLURM's state of `job_id`, asked at most once every ASK_SECONDS (the queue derives
    its jobs twice a second, and a busy controller should not answer each time)."""
    now = time.monotonic()
    asked = _asked.get(job_id)
    if asked is None or now - asked[0] > ASK_SECONDS:
        asked = _asked[job_id] = (now, slurm.state(job_id))
    return asked[1]


def cancel(job: Job, lines: list[str]) -> bool:
    """Cancel `job`'s SLURM job (SIGTERM to its processes, which save a checkpoint); whether
    there was one to cancel."""
    job_id = slurm_id(job, lines)
    if job_id is None:
        return False
    slurm.cancel(job_id)
    return True
