"""Multi-node and SLURM pieces that need no cluster: the sbatch script (parsed by bash
itself), the layout arithmetic, the web app's SLURM device, and the refusals of `difftune
slurm` made before SLURM is asked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from difftune.cli import main
from difftune.cluster.script import Request, script
from difftune.train.nodes import Layout, describe
from difftune.ui.jobs import cluster
from difftune.ui.jobs.store import Job


def test_the_sbatch_script_is_valid_bash_with_the_requested_resources(tmp_path: Path) -> None:
    req = Request(2, 4, "gpu", "1:00:00", "lab", ["--qos=high"])
    text = script(req, tmp_path / "run.toml", ['save.dir="/runs/my run"'], tmp_path / "out",
                  "difftune-out")
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --account=lab",
                 "#SBATCH --qos=high", "#SBATCH --requeue", "#SBATCH --signal=B:TERM@120"):
        assert line + "\n" in text
    assert ("--nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node=4 --rdzv-backend=c10d "
            "--rdzv-endpoint=$head:$port --rdzv-id=$SLURM_JOB_ID -m difftune train") in text
    assert "--set 'save.dir=\"/runs/my run\"'" in text  # quoted for the shell
    cpu = script(Request(1, 0), tmp_path / "run.toml", [], tmp_path / "out", "x")
    assert "--gpus-per-node" not in cpu and "--nproc-per-node=1" in cpu


def test_layout_from_torchrun_and_the_check_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    layout = Layout.from_env()
    assert (layout.nodes, layout.per_node, layout.node_of(5)) == (2, 4, 1)
    lines = describe(layout, 2, 3, 1e-4, ["train", "run.toml"])
    assert "node 0: ranks 0-3, node 1: ranks 4-7; local ranks 0-3" in lines[0]
    assert "2 x 8 processes x train.grad_accum 3 = 48 images per optimizer step" in lines[1]


def test_the_web_apps_slurm_device_and_its_command() -> None:
    assert cluster.parse("slurm") == "slurm:1x1"
    assert cluster.parse("slurm:2x0@cpu-nodes") == "slurm:2x0@cpu-nodes"
    assert not cluster.is_slurm("slurmy") and not cluster.is_slurm("cuda:0")
    with pytest.raises(ValueError, match="1 node or more"):
        cluster.parse("slurm:0x1")
    job = Job(1, "train", Path("/r/run.toml"), ["--set", "train.lr=1", "--resume", "latest"],
              Path("/r/out"), device="slurm:2x8@gpu")
    assert cluster.argv(job, "py")[3:] == [
        "slurm", "submit", "/r/run.toml", "--nodes", "2", "--gpus-per-node", "8",
        "--partition", "gpu", "--resume", "--set", "train.lr=1"]


def test_slurm_refusals_before_slurm_is_asked(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[model]\nflavor = "tiny"\n[[datasets]]\npath = "{tmp_path}"\n'
                   f'[train]\nsteps = 1\ndevice = "cuda"\n[save]\ndir = "{tmp_path / "out"}"\n')
    assert main(["slurm", "submit", str(cfg), "--gpus-per-node", "0"]) == 2
    assert "--gpus-per-node 0 asks for CPU nodes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "lora.safetensors").write_bytes(b"")  # a previous run's result
    assert main(["slurm", "submit", str(cfg), "--gpus-per-node", "1"]) == 2
    assert "(on SLURM: difftune slurm submit ... --resume)" in capsys.readouterr().err
    assert main(["slurm", "status", "not-a-job"]) == 2
    assert "neither a SLURM job id nor a run folder" in capsys.readouterr().err
