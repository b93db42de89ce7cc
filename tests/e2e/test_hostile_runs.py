"""Hostile and unlucky runs through the real CLI (issue 14): nothing a user made is lost, a
second run on the same folder is stopped, and a full disk is one message with exit 2.
Damaged checkpoints, mid-run failures and signals: test_hostile_resume.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from difftune.cache.disk import DiskStore
from difftune.cli import main
from difftune.verbs.demo import demo_config
from difftune.errors import EnvironmentProblem
from difftune.train.checkpoint import CheckpointManager
from difftune.train.state import TrainState
from difftune.train.rundir import RunLock

from .conftest import copy_run, run_toml, steps_of
from .conftest import output_files as files
from .conftest import train_exit_code as train

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Folders on real, tiny file systems (tmpfs of a given KiB size; needs root, as CI has)."""
    mounted: list[Path] = []

    def make(kib: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs",
                               str(where)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"a small tmpfs cannot be mounted here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


# ------------------------------------------------------------------ nothing lost (items 5, 6, 10)


@pytest.mark.parametrize("left", ["checkpoint", "embeddings", "metrics", "samples"])
def test_a_previous_runs_outputs_are_never_overwritten(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str], left: str) -> None:
    """A plain rerun after Ctrl-C (no final LoRA yet) or after an embeddings-only run."""
    cfg = run_toml(tmp_path, images)
    out = tmp_path / "out"
    made = {"checkpoint": out / "checkpoints" / "step-000004" / "state.json",
            "embeddings": out / "embeddings" / "sks.safetensors",
            "metrics": out / "metrics.jsonl", "samples": out / "samples" / "step-000002_00_a.png"}
    made[left].parent.mkdir(parents=True)
    made[left].write_text('{"step": 1}\n')
    before = files(out)
    assert train(cfg) == 2
    err = capsys.readouterr().err
    assert made[left].relative_to(out).parts[0] in err and "--resume latest" in err, err
    assert "Traceback" not in err
    assert files(out) == before


def test_a_second_run_on_the_same_folder_is_stopped(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = copy_run(finished, tmp_path / "run")
    out = tmp_path / "run" / "out"
    before = files(out)
    with RunLock(out):  # what a running `difftune train` holds for its whole run
        assert train(cfg, "train.steps=6", extra=["--resume", "latest"]) == 2
        err = capsys.readouterr().err
        assert "in use by another difftune run" in err and f"pid {os.getpid()}" in err, err
    assert files(out) == before
    assert train(cfg, "train.steps=6", extra=["--resume", "latest"]) == 0  # free again


def test_overwrite_removes_the_replaced_runs_checkpoints(finished: Path, tmp_path: Path) -> None:
    """With save.overwrite a later --resume latest must never pick the old run's step 4."""
    cfg = copy_run(finished, tmp_path / "run")
    out = tmp_path / "run" / "out"
    assert train(cfg, "save.overwrite=true", "train.steps=2", "save.every_n_steps=1") == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001",
                                                                       "step-000002"]
    assert steps_of(out) == [1, 2]


def test_demo_config_is_data_and_demo_refuses_an_existing_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    odd = tmp_path / 'a "quoted" \\ folder'
    cfg = demo_config(odd, steps=1)
    assert cfg.save.dir == odd.resolve() and not cfg.save.overwrite
    assert cfg.train.steps == 1 and cfg.train.warmup_steps == 0
    for steps in range(1, 60):  # every short demo is a valid run (warm-up below its steps)
        assert demo_config(odd, steps).train.steps == steps
    odd.mkdir()
    (odd / "demo-lora.safetensors").write_bytes(b"made by the user")
    assert main(["demo", "--out", str(odd), "--steps", "1"]) == 2
    assert "demo-lora.safetensors" in capsys.readouterr().err
    assert (odd / "demo-lora.safetensors").read_bytes() == b"made by the user"


def test_a_one_step_demo_runs(tmp_path: Path) -> None:
    out = tmp_path / 'demo "out"'
    assert main(["demo", "--out", str(out), "--steps", "1"]) == 0
    assert (out / "before_after.png").is_file() and steps_of(out) == [1]


def test_redone_steps_appear_once_in_metrics(finished: Path, tmp_path: Path) -> None:
    """Resuming from an earlier checkpoint (as after kill -9) redoes steps 3 and 4: each
    appears once; a line cut short by the kill is dropped."""
    cfg = copy_run(finished, tmp_path / "run")
    out = tmp_path / "run" / "out"
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 5, "lo')
    ckpts = out / "checkpoints"
    shutil.rmtree(ckpts / "step-000004")
    assert train(cfg, extra=["--resume", "latest"]) == 0
    assert steps_of(out) == [1, 2, 3, 4]


def test_leftovers_of_an_interrupted_save_are_cleaned(finished: Path, tmp_path: Path) -> None:
    """A temporary checkpoint folder is removed; a checkpoint caught between its two renames
    (moved aside, the new one not yet in place) is put back."""
    cfg = copy_run(finished, tmp_path / "run")
    ckpts = tmp_path / "run" / "out" / "checkpoints"
    shutil.copytree(ckpts / "step-000002", ckpts / ".tmp-step-000005-99")
    (ckpts / "step-000004").rename(ckpts / ".old-step-000004-98")
    (tmp_path / "run" / "out" / ".lora.safetensors.x1.tmp").write_bytes(b"half")
    assert train(cfg, "train.steps=6", extra=["--resume", "latest"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004",
                                                       "step-000006"]
    assert not list((tmp_path / "run" / "out").glob(".*.tmp"))
    assert steps_of(tmp_path / "run" / "out") == list(range(1, 7))


def test_log_every_writes_every_nth_step_and_the_last(tmp_path: Path, images: Path) -> None:
    cfg = run_toml(tmp_path, images, steps=5)
    assert train(cfg, "train.log_every=2") == 0
    assert steps_of(tmp_path / "out") == [2, 4, 5]


# ------------------------------------------------------------------ full disks (item 11)


def test_a_full_save_dir_is_refused_before_the_first_step(
        tmp_path: Path, images: Path, small_disk: Callable[[int], Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    disk = small_disk(1024)
    cfg = run_toml(tmp_path, images)
    assert train(cfg, f'save.dir="{(disk / "out").as_posix()}"') == 2
    err = capsys.readouterr().err
    assert str(disk / "out") in err and "needed" in err and "MiB free" in err, err
    assert "Traceback" not in err and not (disk / "out" / "metrics.jsonl").exists()


def test_a_disk_filling_up_mid_run_loses_nothing(
        tmp_path: Path, images: Path, small_disk: Callable[[int], Path],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    disk = small_disk(16 << 10)
    out = disk / "out"
    cfg = run_toml(tmp_path, images)
    cfg.write_text(cfg.read_text().replace((tmp_path / "out").as_posix(), out.as_posix()))
    real = CheckpointManager.save

    def fill_then_save(self: CheckpointManager, state: TrainState) -> Path:
        if state.step == 4:  # something else filled the disk meanwhile
            with open(disk / "filler", "wb") as f, pytest.raises(OSError):
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
        return real(self, state)

    monkeypatch.setattr(CheckpointManager, "save", fill_then_save)
    assert train(cfg, "train.steps=4", "save.every_n_steps=2") == 2
    err = capsys.readouterr().err
    assert str(out) in err and "needed" in err and "Traceback" not in err, err
    ckpts = out / "checkpoints"
    assert [p.name for p in ckpts.iterdir()] == ["step-000002"]  # no half-written folder
    saved = files(ckpts)
    (disk / "filler").unlink()
    monkeypatch.setattr(CheckpointManager, "save", real)
    assert train(cfg, "train.steps=4", "save.every_n_steps=2", extra=["--resume", "latest"]) == 0
    assert {p: b for p, b in files(ckpts).items() if "step-000002" in str(p)} == saved


def test_a_full_cache_folder_is_one_message(
        tmp_path: Path, images: Path, small_disk: Callable[[int], Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    disk = small_disk(16)
    cfg = run_toml(tmp_path, images, extra='[cache]\nlatents = "disk"\ntext = "disk"\n'
                   f'dir = "{disk.as_posix()}"\n')
    assert train(cfg) == 2
    err = capsys.readouterr().err
    assert str(disk) in err and "needed" in err and "Traceback" not in err, err


def test_cache_writes_past_the_queue_bound_fail_as_one_message(
        small_disk: Callable[[int], Path]) -> None:
    """More queued entries than the writer keeps (64) on a disk that fills up: the failure
    comes back as EnvironmentProblem, never as a bare OSError."""
    store = DiskStore(small_disk(512), "latents")
    entry = {"latent": torch.zeros(16, 1024)}  # 64 KiB
    with pytest.raises(EnvironmentProblem, match="needed"):
        for i in range(100):
            store.put(f"{i:064x}", entry, {})
        store.flush()


def test_a_fill_that_cannot_fit_is_refused_at_its_first_entry(
        small_disk: Callable[[int], Path]) -> None:
    store = DiskStore(small_disk(512), "latents")
    keys = [f"{i:064x}" for i in range(100)]
    assert store.missing(keys) == set(keys)
    with pytest.raises(EnvironmentProblem, match="100 cache entries"):
        store.put(keys[0], {"latent": torch.zeros(16, 1024)}, {})
