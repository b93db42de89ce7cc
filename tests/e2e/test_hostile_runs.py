"""Hostile and unlucky runs through the real CLI (issue 14): nothing a user made is lost, a
second run on the same folder is stopped, a full disk or a damaged checkpoint is one message
with exit 2, a step that fails leaves the last good step resumable, and signals, odd prompt
files and images vanishing mid-run never cost the run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cache.disk import DiskStore
from difftune.cli import main
from difftune.verbs.demo import demo_config
from difftune.errors import EnvironmentProblem
from difftune.sample.prompts import PromptSpec, read_prompts
from difftune.sample.runner import SampleRunner
from difftune.train.checkpoint import CheckpointManager
from difftune.train.rundir import RunLock
from difftune.train.state import TrainState

from .conftest import run_toml

EVERY_2 = ["save.every_n_steps=2"]


def train(cfg: Path, *sets: str, extra: list[str] | None = None) -> int:
    args = ["train", str(cfg), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    return main(args + (extra or []))


def steps_of(out: Path) -> list[int]:
    return [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]


def files(out: Path, skip: tuple[str, ...] = ("difftune.log",)) -> dict:
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name not in skip}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A 4-step run with checkpoints after steps 2 and 4 (its run file; outputs in out/)."""
    folder = tmp_path_factory.mktemp("finished")
    cfg = run_toml(folder, images)
    assert train(cfg, *EVERY_2) == 0
    return cfg


def copy_run(cfg: Path, where: Path) -> Path:
    """A copy of a run's folder (run file, out/) whose run file points at the copy."""
    shutil.copytree(cfg.parent, where, dirs_exist_ok=True)
    text = cfg.read_text(encoding="utf-8").replace(cfg.parent.as_posix(), where.as_posix())
    (where / "run.toml").write_text(text, encoding="utf-8")
    return where / "run.toml"


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


# ------------------------------------------------------------------ damaged checkpoints (item 12)


def _state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


DAMAGE: dict[str, Callable[[Path], str]] = {}


def damage(fn: Callable[[Path], str]) -> Callable[[Path], str]:
    DAMAGE[fn.__name__] = fn
    return fn


def _edit_state(folder: Path, edit: Callable[[dict], object]) -> None:
    doc = _state(folder)
    edit(doc)
    (folder / "state.json").write_text(json.dumps(doc))


@damage
def no_identity(folder: Path) -> str:
    _edit_state(folder, lambda d: d.pop("identity"))
    return "identity"


@damage
def no_sampler(folder: Path) -> str:
    _edit_state(folder, lambda d: d.pop("sampler"))
    return "sampler"


@damage
def not_an_object(folder: Path) -> str:
    (folder / "state.json").write_text("[1, 2, 3]")
    return "not a checkpoint's state object"


@damage
def position_not_an_integer(folder: Path) -> str:
    _edit_state(folder, lambda d: d["sampler"].update(position="3"))
    return "sampler.position"


def _retensor(path: Path, name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> None:
    tensors = load_file(str(path))
    key = next(k for k in tensors if name in k)
    tensors[key] = value(tensors[key])
    save_file(tensors, str(path))


@damage
def rng_of_the_wrong_shape(folder: Path) -> str:
    _retensor(folder / "rng.safetensors", "generator", lambda t: t[:100])
    return "rng.safetensors"


@damage
def trainable_of_the_wrong_shape(folder: Path) -> str:
    _retensor(folder / "trainable.safetensors", "lora_A", lambda t: torch.zeros(3, 7))
    return "trainable.safetensors"


@damage
def optimizer_of_the_wrong_shape(folder: Path) -> str:
    _retensor(folder / "optimizer.safetensors", "exp_avg_sq", lambda t: t.flatten()[:5])
    return "optimizer.safetensors"


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_before_the_model_loads(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str) -> None:
    cfg = copy_run(finished, tmp_path / "run")
    folder = tmp_path / "run" / "out" / "checkpoints" / "step-000004"
    needle = DAMAGE[how](folder)
    assert train(cfg, "train.steps=6", extra=["--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert "damaged" in err and needle in err and "Traceback" not in err, err
    assert "loading flux model" not in err  # refused before any weights load


def test_resume_with_changed_data_is_refused_before_the_model_loads(
        finished: Path, tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(images, data)
    cfg = copy_run(finished, tmp_path / "run")
    cfg.write_text(cfg.read_text().replace(images.as_posix(), data.as_posix()))
    first = sorted(data.glob("*.png"))[0]
    shutil.copy(first, data / "added.png")
    shutil.copy(first.with_suffix(".txt"), data / "added.txt")
    assert train(cfg, "train.steps=6", extra=["--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert "datasets changed" in err and "6 items then, 7 now" in err, err
    assert "loading flux model" not in err


# ------------------------------------------------------------------ mid-run failures (item 15)


def test_an_image_deleted_mid_run_is_skipped(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    shutil.copytree(images, data)
    gone, broken = sorted(data.glob("*.png"))[:2]
    cfg = run_toml(tmp_path, data, extra='[cache]\nlatents = "none"\n')
    import difftune.verbs.train as commands

    real = commands.fill_caches

    def then_vanish(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)
        gone.unlink()
        broken.write_bytes(b"not a png any more")

    monkeypatch.setattr(commands, "fill_caches", then_vanish)
    assert train(cfg) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "cannot be read any more" in line]
    assert len(warned) == 2 and str(gone) in warned[0] + warned[1], err
    assert str(broken) in warned[0] + warned[1]
    assert steps_of(tmp_path / "out") == [1, 2, 3, 4]


def test_a_failing_step_leaves_the_last_good_one_resumable_exactly(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole, failing = run_toml(tmp_path / "a", images), run_toml(tmp_path / "b", images)
    assert train(whole, "adapter.dropout=0.1") == 0
    from difftune.families.flux.family import FluxFamily

    real, calls = FluxFamily.predict, []

    def third_fails(self: FluxFamily, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FluxFamily, "predict", third_fails)
    assert train(failing, "adapter.dropout=0.1") == 1
    err = capsys.readouterr().err
    assert "simulated failure" in err and "the last good step (2) was saved" in err, err
    assert "--resume latest" in err
    monkeypatch.setattr(FluxFamily, "predict", real)
    assert train(failing, "adapter.dropout=0.1", extra=["--resume", "latest"]) == 0
    a = load_file(str(tmp_path / "a" / "out" / "lora.safetensors"))
    b = load_file(str(tmp_path / "b" / "out" / "lora.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ signals, prompt files (16)


def test_a_fifo_or_device_as_prompt_file_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    got: list[object] = []
    default = PromptSpec("", "", 64, 64, 8, 0, 1.0, 1.0)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        reader = threading.Thread(target=lambda p=path: got.append(read_prompts(p, default)),
                                  daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), f"reading {path} blocked"
    assert got == [[], [], []]
    big = tmp_path / "big.txt"
    big.write_text("a prompt\n" * 200_000)
    assert read_prompts(big, default) == []


def test_sigterm_during_a_sample_event_stops_after_the_current_image(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two SIGTERMs during the step-2 event: one image, then a whole checkpoint, exit 0."""
    prompts = tmp_path / "many.txt"
    prompts.write_text("".join(f"prompt {i} --w 32 --h 32 --s 1\n" for i in range(8)))
    cfg = run_toml(tmp_path, images, prompts=prompts)
    real = SampleRunner.generate

    def signalled(self: SampleRunner, spec: PromptSpec) -> object:
        image = real(self, spec)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one never cuts the save short
        return image

    monkeypatch.setattr(SampleRunner, "generate", signalled)
    assert train(cfg, "sample.at_start=false") == 0
    captured = capsys.readouterr()
    assert "stopped after step 2" in captured.out and "already stopping" in captured.err
    out = tmp_path / "out"
    assert len(list((out / "samples").glob("step-000002_0*.png"))) == 1
    assert (out / "checkpoints" / "step-000002" / "state.json").is_file()
    monkeypatch.setattr(SampleRunner, "generate", real)
    assert train(cfg, "sample.at_start=false", extra=["--resume", "latest"]) == 0
    assert steps_of(out) == [1, 2, 3, 4]
