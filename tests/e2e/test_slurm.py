"""`difftune slurm` against a real SLURM (tests/slurm_cluster.py: Debian's slurmctld and
slurmd for this host, started once per session), on CPU nodes (`--gpus-per-node 0`, gloo).

One job covers the life of a run on the cluster: submitted, running, preempted (SIGTERM to its
batch shell, what `--signal=B:TERM@120` sends before the time limit), requeued by its script,
restarted, resumed from the checkpoint it saved, and completed; its state read back through
`difftune slurm status`. Exactness as in the resume tests: the same (step, loss) rows and a
bitwise equal LoRA as the uninterrupted run. SLURM holds a requeued job until the credentials
of its first start expire (AuthInfo=cred_expire, 10 s in the test SLURM, 120 s by default).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from difftune.cli import main
from difftune.cluster import slurm

from .conftest import assert_same_lora, metrics_rows, run_toml

STEPS = 20


def wait_for(check: Callable[[], bool], what: str, timeout: float = 180) -> None:
    """Poll `check` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_a_bad_partition_is_refused_with_slurms_reason(slurm_cluster: Path, tmp_path: Path,
                                                       images: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    assert main(["slurm", "submit", str(cfg), "--gpus-per-node", "0",
                 "--partition", "no-such-partition"]) == 2
    err = capsys.readouterr().err
    assert "SLURM refused the job" in err and "Invalid partition name specified" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written for a refused job


def test_a_preempted_job_is_requeued_resumes_exactly_and_completes(
        slurm_cluster: Path, tmp_path: Path, images: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path / "job", images, steps=STEPS)
    out = tmp_path / "job" / "out"
    assert main(["slurm", "submit", str(cfg), "--gpus-per-node", "0",
                 "--set", "save.every_n_steps=2"]) == 0
    job = (out / "slurm-jobs.txt").read_text().split()[-1]
    assert f"submitted job {job}" in capsys.readouterr().out
    script = (out / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "--rdzv-backend=c10d" in script
    assert "--nproc-per-node=1" in script and f"sbatch {out / 'slurm.sbatch'}" in script
    wait_for(lambda: (out / "checkpoints" / "step-000002" / "state.json").is_file(),
             "the job's first checkpoint")
    subprocess.run(["scancel", "--signal=TERM", "--batch", job], check=True)
    wait_for(lambda: slurm.state(job).restarts == 1, "the job to be requeued")
    stopped = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert f"step-{STEPS:06d}" not in stopped  # stopped before the end, with a checkpoint
    wait_for(lambda: slurm.state(job).finished, "the requeued job to end")
    assert main(["slurm", "status", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"job {job}: COMPLETED (requeued 1 time(s))"
    log = (out / f"slurm-{job}.out").read_text()
    assert "stop requested (SIGTERM)" in log and f"requeueing job {job}" in log
    reference = run_toml(tmp_path / "ref", images, steps=STEPS)
    assert main(["train", str(reference), "--no-progress", "--set", "save.every_n_steps=2"]) == 0
    rows = [[(r["step"], r["loss"]) for r in metrics_rows(o)]
            for o in (out, reference.parent / "out")]
    assert rows[0] == rows[1] and len(rows[0]) == STEPS
    assert_same_lora(out, reference.parent / "out")
