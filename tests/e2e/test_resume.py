"""Checkpoints and exact resume through the real CLI: a run stopped by a signal mid-epoch and
resumed ends bitwise equal to an uninterrupted one (gradient accumulation, shuffling, caption
augmentations, flips; also on an int8-quantized bf16 base); incompatible resumes refused with
nothing overwritten; --init-lora from diffusers and kohya files; pickles never loaded."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.report.metrics import Reporter

from .conftest import run_toml
from .conftest import train_exit_code as train

AUGMENT = ["datasets.0.shuffle_caption=true", "datasets.0.caption_tag_dropout_rate=0.3",
           "datasets.0.flip=true", "train.grad_accum=2", "adapter.dropout=0.1",
           'train.scheduler="cosine"', "train.warmup_steps=2", "save.every_n_steps=3",
           "save.keep_last=2"]
QUANTIZED = ['precision.mixed="bf16"', 'precision.quantize.denoiser="int8"']


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def stop_at(monkeypatch: pytest.MonkeyPatch, step: int, sig: int = signal.SIGINT) -> None:
    """Deliver a real signal to this process while step `step` is being reported."""
    real = Reporter.step

    def reporting(self: Reporter, s: int, *args: object, **kwargs: object) -> None:
        real(self, s, *args, **kwargs)
        if s == step:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(Reporter, "step", reporting)


@pytest.mark.parametrize("extra", [[], QUANTIZED], ids=["fp32", "int8-bf16"])
def test_stopped_and_resumed_run_equals_an_uninterrupted_one(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    sets = AUGMENT + extra
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = run_toml(tmp_path / "a", images, steps=8), run_toml(tmp_path / "b", images, steps=8)
    assert train(a, *sets) == 0
    with monkeypatch.context() as mp:
        stop_at(mp, 4, signal.SIGINT)  # step 4 of 8: mid-epoch (3 batches of 2 per epoch)
        assert train(b, *sets) == 0
    out = capsys.readouterr().out
    assert "stopped after step 4" in out and "--resume latest" in out
    assert not (tmp_path / "b" / "out" / "lora.safetensors").exists()
    assert train(b, *sets, extra=["--resume", "latest"]) == 0
    assert losses(tmp_path / "b" / "out") == losses(tmp_path / "a" / "out")  # bitwise
    la = load_file(str(tmp_path / "a" / "out" / "lora.safetensors"))
    lb = load_file(str(tmp_path / "b" / "out" / "lora.safetensors"))
    assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
    kept = sorted(p.name for p in (tmp_path / "b" / "out" / "checkpoints").iterdir())
    assert kept == ["step-000006", "step-000008"]  # keep_last = 2


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """An int8-quantized run stopped by SIGTERM after step 2 (a checkpoint at step 2)."""
    folder = tmp_path_factory.mktemp("stopped")
    cfg = run_toml(folder, images, steps=6)
    with pytest.MonkeyPatch.context() as mp:
        stop_at(mp, 2, signal.SIGTERM)
        assert train(cfg, *QUANTIZED) == 0
    return folder


def _copy(stopped: Path, tmp_path: Path) -> Path:
    folder = Path(shutil.copytree(stopped, tmp_path / "run"))
    cfg = folder / "run.toml"
    cfg.write_text(cfg.read_text().replace(str(stopped), str(folder)))
    return cfg


def test_resume_on_another_precision(stopped: Path, tmp_path: Path) -> None:
    cfg = _copy(stopped, tmp_path)
    assert train(cfg, extra=["--resume", "latest"]) == 0  # int8 bf16 -> plain fp32
    rows = losses(cfg.parent / "out")
    assert [s for s, _ in rows] == list(range(1, 7))
    assert all(torch.isfinite(torch.tensor(v)) for _, v in rows)
    # ... and back: the fp32 run's final checkpoint goes on, quantized, to a longer run.
    assert train(cfg, *QUANTIZED, "train.steps=8", extra=["--resume", "latest"]) == 0
    rows = losses(cfg.parent / "out")
    assert [s for s, _ in rows] == list(range(1, 9))
    assert all(torch.isfinite(torch.tensor(v)) for _, v in rows)


@pytest.mark.parametrize("sets, needles", [
    (["adapter.rank=8"], ["rank: checkpoint 4, config 8"]),
    (['adapter.text_encoders=["clip_l"]', 'model.family="sd3"'],
     ["family: checkpoint 'flux', config 'sd3'", "text_encoders: checkpoint [], config ['clip_l']"]),
    (['adapter.targets="attention"'], ["targets: checkpoint"]),
])
def test_incompatible_resume_names_each_difference_and_overwrites_nothing(
        stopped: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: list[str],
        needles: list[str]) -> None:
    cfg = _copy(stopped, tmp_path)
    out = cfg.parent / "out"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "difftune.log"}
    assert train(cfg, *sets, extra=["--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "difftune.log"}
    assert after == before


def test_changed_lr_and_steps_are_a_warning(stopped: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _copy(stopped, tmp_path)
    assert train(cfg, *QUANTIZED, "train.lr=5e-3", "train.steps=5",
                 extra=["--resume", "latest"]) == 0
    err = capsys.readouterr().err
    assert "resuming with train.lr = 0.005" in err and "resuming with train.steps = 5" in err
    assert [s for s, _ in losses(cfg.parent / "out")] == [1, 2, 3, 4, 5]
    rows = [json.loads(r) for r in (cfg.parent / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [1e-2, 1e-2, 5e-3, 5e-3, 5e-3]  # from the next step on


def test_interrupted_save_is_never_latest(stopped: Path, tmp_path: Path) -> None:
    cfg = _copy(stopped, tmp_path)
    root = cfg.parent / "out" / "checkpoints"
    shutil.copytree(root / "step-000002", root / ".tmp-step-000003-99")
    broken = Path(shutil.copytree(root / "step-000002", root / "step-000004"))
    (broken / "state.json").unlink()  # killed before its last file
    assert train(cfg, *QUANTIZED, extra=["--resume", "latest"]) == 0
    assert [s for s, _ in losses(cfg.parent / "out")] == list(range(1, 7))


class _Evil:
    """Unpickling this writes a marker file: proof that a loader ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.write_text, (self.marker, "code ran"))


def test_pickles_are_refused_and_never_run(stopped: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _copy(stopped, tmp_path)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(marker))
    ckpt = cfg.parent / "out" / "checkpoints" / "step-000002"
    (tmp_path / "evil.ckpt").write_bytes(payload)
    assert train(cfg, extra=["--resume", str(tmp_path / "evil.ckpt")]) == 2
    assert "pickle" in capsys.readouterr().err
    (ckpt / "trainable.safetensors").write_bytes(payload)  # a pickle under a safe name
    assert train(cfg, *QUANTIZED, extra=["--resume", "latest"]) == 2
    assert "cannot be read" in capsys.readouterr().err
    (ckpt / "optimizer.pt").write_bytes(payload)
    assert train(cfg, *QUANTIZED, extra=["--resume", "latest"]) == 2
    assert "optimizer.pt" in capsys.readouterr().err
    (tmp_path / "lora.bin").write_bytes(payload)
    (tmp_path / "lora.safetensors").write_bytes(payload)
    for name in ("lora.bin", "lora.safetensors"):
        assert train(cfg, "save.overwrite=true", extra=["--init-lora", str(tmp_path / name)]) == 2
    assert not marker.exists()
