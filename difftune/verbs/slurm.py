"""`difftune slurm submit|status|cancel`: hand a run to the cluster's SLURM and follow it.

`submit` checks the run file as `train` would, writes `<save.dir>/slurm.sbatch` (see
cluster/script.py), submits it with sbatch and notes the job id in `<save.dir>/slurm-jobs.txt`,
so `status` and `cancel` take either a job id or the run folder.
"""

from __future__ import annotations

import time
from pathlib import Path

from difftune.cluster import slurm
from difftune.cluster.script import SCRIPT, Request, script
from difftune.config import RunConfig
from difftune.errors import ConfigError
from difftune.files.atomic import write_atomically
from difftune.train.rundir import refuse_overwrite

JOBS = "slurm-jobs.txt"  # the run folder's job ids, one a line, newest last


def device_sets(cfg: RunConfig, req: Request) -> list[str]:
    """The `--set` the job adds for its nodes: CPU training where no GPU is asked for."""
    if req.gpus_per_node:
        return []
    if cfg.train.device == "cuda":
        raise ConfigError('train.device = "cuda" but --gpus-per-node 0 asks for CPU nodes; '
                          "give --gpus-per-node G, or set train.device = \"cpu\" or \"auto\"")
    return [] if cfg.train.device == "cpu" else ['train.device="cpu"']


def script_text(cfg: RunConfig, config: Path, overrides: list[str], req: Request) -> str:
    """The run's sbatch script."""
    if req.nodes < 1 or req.gpus_per_node < 0:
        raise ConfigError("--nodes must be 1 or more and --gpus-per-node 0 or more")
    run_dir = cfg.save.dir.resolve()
    return script(req, config.resolve(), overrides + device_sets(cfg, req), run_dir,
                  f"difftune-{run_dir.name}")


def write_script(run_dir: Path, text: str) -> Path:
    """Write the run's sbatch script into its folder; a different one already there (edited
    by hand, say) is kept as `slurm.sbatch.<time>`."""
    path = run_dir / SCRIPT
    run_dir.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_text(encoding="utf-8") != text:
        path.rename(path.with_name(f"{SCRIPT}.{time.strftime('%Y%m%d-%H%M%S')}"))
    write_atomically(path, text.encode("utf-8"), 0o644)
    return path


def run_submit(cfg: RunConfig, config: Path, overrides: list[str], req: Request,
               resume: bool = False) -> tuple[str, Path]:
    """Submit the run's script and write it next to the run; the job id and the script's
    path. Without `resume`, a run folder holding a previous run's outputs is refused (as
    `train` does); a job SLURM refuses leaves the folder as it was."""
    if not resume:
        try:
            refuse_overwrite(cfg)
        except ConfigError as err:
            raise ConfigError(f"{err} (on SLURM: difftune slurm submit ... --resume)") from None
    text = script_text(cfg, config, overrides, req)
    made = not cfg.save.dir.exists()
    cfg.save.dir.mkdir(parents=True, exist_ok=True)  # SLURM writes the job's output there
    try:
        job = slurm.submit(text, cfg.save.dir)
    except ConfigError:
        if made:
            cfg.save.dir.rmdir()
        raise
    path = write_script(cfg.save.dir.resolve(), text)
    with (path.parent / JOBS).open("a", encoding="utf-8") as f:
        f.write(job + "\n")
    return job, path


def job_of(target: str) -> str:
    """A job id as given, or the newest job of a run folder."""
    folder = Path(target)
    if not folder.is_dir():
        if not target.split("_")[0].isdigit():
            raise ConfigError(f"{target} is neither a SLURM job id nor a run folder")
        return target
    ids = (folder / JOBS).read_text().split() if (folder / JOBS).is_file() else []
    if not ids:
        raise ConfigError(f"{folder} has no {JOBS}: no job was submitted from it with "
                          "difftune slurm submit; give the job id")
    return ids[-1]


def run_status(target: str) -> slurm.JobState:
    """`difftune slurm status JOB|RUN_DIR`."""
    return slurm.state(job_of(target))


def run_cancel(target: str) -> str:
    """`difftune slurm cancel JOB|RUN_DIR`; the job id cancelled."""
    job = job_of(target)
    slurm.cancel(job)
    return job
