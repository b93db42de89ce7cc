"""The sbatch script of `difftune slurm submit`: one readable file, written next to the run
(`<save.dir>/slurm.sbatch`) so that it can also be read, edited and submitted by hand.

What it does on the cluster: `srun` starts one torchrun per node, which meet through torchrun's
c10d rendezvous on the job's first node (its port derived from the job id, so two jobs on one
node do not collide) and start G training processes each. SIGTERM to the batch shell (SLURM's
`--signal=B:TERM@120` before the time limit, a preemption, `scancel --signal=TERM --batch`) is
passed to the training processes, which finish their step, save a checkpoint and exit; the
script then requeues the job (`scontrol requeue`), and the restarted job resumes from the
latest checkpoint (`--resume latest`), exactly as an uninterrupted run.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = "slurm.sbatch"  # the file's name in the run folder
WARNING_SECONDS = 120  # SIGTERM this long before the time limit: time to save a checkpoint


@dataclass(frozen=True)
class Request:
    """What the job asks SLURM for (the options of `difftune slurm submit`)."""

    nodes: int = 1
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    extra: list[str] = field(default_factory=list)  # further sbatch options, as given

    @property
    def per_node(self) -> int:
        """Training processes per node: one per GPU, or one on a CPU node."""
        return max(1, self.gpus_per_node)


def directives(req: Request, name: str, run_dir: Path) -> list[str]:
    """The #SBATCH lines."""
    lines = [f"--job-name={name}", f"--nodes={req.nodes}", "--ntasks-per-node=1",
             f"--output={run_dir / 'slurm-%j.out'}", "--open-mode=append", "--requeue",
             f"--signal=B:TERM@{WARNING_SECONDS}"]
    if req.gpus_per_node:
        lines.append(f"--gpus-per-node={req.gpus_per_node}")
    for option, value in (("partition", req.partition), ("time", req.time),
                          ("account", req.account)):
        if value:
            lines.append(f"--{option}={value}")
    return [f"#SBATCH {line}" for line in lines + list(req.extra)]


def script(req: Request, config: Path, sets: list[str], run_dir: Path, name: str) -> str:
    """The whole script for `difftune train CONFIG --set ...` on `req`'s nodes."""
    raw = ["--nnodes=$SLURM_JOB_NUM_NODES", "--rdzv-endpoint=$head:$port",
           "--rdzv-id=$SLURM_JOB_ID"]  # expanded by the shell on the cluster (no spaces)
    words = [sys.executable, "-m", "torch.distributed.run", raw[0],
             f"--nproc-per-node={req.per_node}", "--rdzv-backend=c10d", *raw[1:], "-m",
             "difftune", "train", str(config), "--no-progress",
             *[a for s in sets for a in ("--set", s)]]
    train = " ".join(w if w in raw else shlex.quote(w) for w in words)
    checkpoints = shlex.quote(str(run_dir / "checkpoints"))
    header = "\n".join(directives(req, name, run_dir))
    return f"""#!/bin/bash
# difftune on SLURM: {req.nodes} node(s) x {req.per_node} training process(es), run folder
# {run_dir}. Written by `difftune slurm submit`; to submit it again by hand:
#   sbatch {run_dir / SCRIPT}
{header}

# The first node of the job hosts torchrun's rendezvous.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))

# A restarted (requeued) job continues from its latest complete checkpoint.
resume=()
if compgen -G {checkpoints}'/step-*/state.json' > /dev/null; then
    resume=(--resume latest)
fi

# SIGTERM (preemption, the time limit, scancel --signal=TERM --batch): the training
# processes finish their step and save a checkpoint; the job is then requeued, unless it was
# cancelled (scancel JOB signals every process of the job, this shell too).
# (Sent to the training step, job step 0, not to srun: srun would end the step at once.)
stopping=0
trap 'stopping=1; scancel --signal=TERM "$SLURM_JOB_ID.0" 2>/dev/null' TERM

srun --kill-on-bad-exit=1 {train} "${{resume[@]}}" &
step=$!
wait "$step"
code=$?
if [ "$stopping" = 1 ]; then
    wait "$step"
    if scontrol show job -o "$SLURM_JOB_ID" | grep -Eq 'JobState=(CANCELLED|COMPLETING)'; then
        echo "difftune: job $SLURM_JOB_ID was cancelled; its latest checkpoint resumes with" \
            "difftune slurm submit ... --resume"
        exit 0
    fi
    echo "difftune: stopped by SIGTERM; requeueing job $SLURM_JOB_ID to resume from the latest checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$code"
"""
