"""Hostile and unlucky runs through the real CLI (issue 14), continued: a damaged checkpoint is
one message with exit 2, a step that fails leaves the last good step resumable, and signals,
odd prompt files and images vanishing mid-run never cost the run."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.report.logs import _RunLogHandler
from difftune.report.metrics import Reporter
from difftune.sample.prompts import PromptSpec, read_prompts
from difftune.sample.runner import SampleRunner

from .conftest import copy_run, run_toml, steps_of
from .conftest import train_exit_code as train

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

    def signalled(self: SampleRunner, spec: PromptSpec, *args: object) -> object:
        image = real(self, spec, *args)
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


class _SignallingFile(io.RawIOBase):
    """A run log file whose next write, once armed, first sends SIGINT to this process: the
    Python signal handler then runs while logging holds the file's buffered writer."""

    def __init__(self, path: str) -> None:
        self.file = io.FileIO(path, "a")
        self.armed = False

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()
        super().close()


def test_a_signal_during_a_logging_call_stops_cleanly_with_the_run_log_intact(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """SIGINT arriving inside the run log's write (same thread) is one message, the run stops
    after that step, and the run log keeps being written (it was disabled by a "reentrant
    call" when the signal handler itself logged)."""
    raw: list[_SignallingFile] = []

    def signalling_open(self: logging.FileHandler) -> io.TextIOWrapper:
        raw.append(_SignallingFile(self.baseFilename))
        return io.TextIOWrapper(io.BufferedWriter(raw[-1]), encoding="utf-8")

    real = Reporter.step

    def reporting(self: Reporter, s: int, *args: object, **kwargs: object) -> None:
        real(self, s, *args, **kwargs)
        if s == 1:
            raw[-1].armed = True
            logging.getLogger("difftune").info("step 1 reported")

    monkeypatch.setattr(_RunLogHandler, "_open", signalling_open)
    monkeypatch.setattr(Reporter, "step", reporting)
    assert train(run_toml(tmp_path, images, steps=3)) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "stopped after step 1" in captured.out
    assert err.count("stop requested (SIGINT)") == 1 and "Logging error" not in err
    assert "cannot be written any more" not in err
    log = (tmp_path / "out" / "difftune.log").read_text()
    assert log.count("stop requested (SIGINT)") == 1
    order = [log.index(m) for m in ("step 1 reported", "stop requested", "saved checkpoint")]
    assert order == sorted(order)
    assert steps_of(tmp_path / "out") == [1]
