"""SLURM's own commands, run as subprocesses: sbatch, scontrol, sacct, scancel.

difftune keeps no scheduler state of its own: a job's state is what SLURM says, read when asked
(`scontrol show job` while SLURM remembers the job, then `sacct` where accounting is kept).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from difftune.errors import ConfigError, EnvironmentProblem

TIMEOUT = 60  # seconds for one SLURM command (a busy controller answers slowly)


@dataclass(frozen=True)
class JobState:
    """A job as SLURM reports it."""

    job: str
    state: str  # PENDING, RUNNING, REQUEUED, COMPLETED, FAILED, CANCELLED, ... or UNKNOWN
    reason: str = ""  # why it waits or failed (SLURM's word: Resources, NonZeroExitCode...)
    restarts: int = 0  # how often it was requeued
    exit_code: str = ""
    nodes: str = ""

    @property
    def finished(self) -> bool:
        """Whether SLURM is done with the job (it will not run again by itself)."""
        return self.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "UNKNOWN")

    def describe(self) -> str:
        """One line: `job 12: RUNNING on node1 (requeued 1 time)`."""
        words = [f"job {self.job}: {self.state}"]
        if self.nodes and self.state == "RUNNING":
            words.append(f"on {self.nodes}")
        why = [self.reason] if self.reason and self.reason != "None" else []
        if self.exit_code and self.exit_code != "0:0":
            why.append(f"exit code {self.exit_code}")
        if self.restarts:
            why.append(f"requeued {self.restarts} time(s)")
        return " ".join(words) + (f" ({', '.join(why)})" if why else "")


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """One SLURM command; a clear error where SLURM's commands are missing."""
    if shutil.which(args[0]) is None:
        raise EnvironmentProblem(f"{args[0]} not found: run difftune slurm on a machine with "
                                 "SLURM's commands (a login node of the cluster)")
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=TIMEOUT)


def _reason(done: subprocess.CompletedProcess[str]) -> str:
    """SLURM's own words from a failed command (its last error line)."""
    lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {done.returncode}"


def submit(text: str, where: Path) -> str:
    """`sbatch` of the script `text` (read from stdin, so a refused script is never written
    over the run's), the job id; `where` names the run in errors. A refusal (a bad
    partition, account, time) is a ConfigError with SLURM's reason."""
    done = _run(["sbatch", "--parsable"], stdin=text)
    if done.returncode != 0:
        raise ConfigError(f"SLURM refused the job of {where}: {_reason(done)}; fix the "
                          "option it names (--partition, --account, --time, --extra)")
    return done.stdout.strip().split(";")[0]


def state(job: str) -> JobState:
    """The job's state now (UNKNOWN where SLURM no longer knows it)."""
    done = _run(["scontrol", "show", "job", "-o", job])
    if done.returncode == 0 and "JobState=" in done.stdout:
        fields = dict(word.split("=", 1) for word in done.stdout.split() if "=" in word)
        return JobState(job, fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""),
                        int(fields.get("Restarts", "0") or 0), fields.get("ExitCode", ""),
                        fields.get("NodeList", ""))
    if shutil.which("sacct"):
        acct = _run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,Reason,ExitCode,NodeList"])
        rows = [r.split("|") for r in acct.stdout.splitlines() if r.count("|") == 3]
        if acct.returncode == 0 and rows:
            word, reason, code, nodes = rows[-1]
            return JobState(job, word.split()[0], reason, 0, code, nodes)
    return JobState(job, "UNKNOWN", "SLURM no longer knows this job")


def cancel(job: str) -> None:
    """`scancel job`; SLURM's reason where it refuses."""
    done = _run(["scancel", job])
    if done.returncode != 0:
        raise ConfigError(f"SLURM did not cancel job {job}: {_reason(done)}")
