"""Validation loss end to end on tiny FLUX.1: it never changes training, lands on the right
metrics rows with the same value on every run, keeps the best, stops early, resumes exactly,
and `check` reports it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main

from .conftest import (assert_same_lora, metrics_rows, run_toml, stopped_and_resumed,
                       train_exit_code)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A validation folder of its own: two of the demo images."""
    folder = tmp_path_factory.mktemp("held")
    for png in sorted(images.glob("*.png"))[:2]:
        shutil.copy(png, folder / png.name)
        shutil.copy(png.with_suffix(".txt"), folder / png.with_suffix(".txt").name)
    return folder


def _val(held: Path, **keys: object) -> str:
    lines = [f'path = "{held.as_posix()}"'] + [f"{k} = {v}" for k, v in keys.items()]
    return "\n[validation]\n" + "\n".join(lines) + "\n"


def _val_rows(out: Path) -> dict[int, tuple[float, dict]]:
    return {r["step"]: (r["val_loss"], r["val_loss_by_t"]) for r in metrics_rows(out)
            if "val_loss" in r}


def test_validation_never_changes_training_and_resumes_exactly(
        tmp_path: Path, images: Path, held: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # min_delta 100: only the first evaluation improves, so the record after the resume
    # (best of step 2, 2 evaluations without improving) comes from the checkpoint alone.
    extra = _val(held, every_n_steps=2, keep_best="true", min_delta=100)
    plain = run_toml(tmp_path / "plain", images, steps=5)
    sets = ("train.log_every=3", "adapter.dropout=0.2")  # dropout: the global RNG is in play
    assert train_exit_code(plain, *sets) == 0
    a, b = (run_toml(tmp_path / n, images, extra=extra, steps=5) for n in "ab")
    rows_a, rows_b = stopped_and_resumed(a, b, monkeypatch, 3, *sets)
    assert_same_lora(tmp_path / "plain" / "out", tmp_path / "a" / "out")  # bit for bit
    val = _val_rows(tmp_path / "a" / "out")
    assert sorted(val) == [2, 4, 5]  # every 2 steps and the last, written despite log_every
    assert all(len(by_t) == 4 for _, by_t in val.values())
    assert val == _val_rows(tmp_path / "b" / "out")  # the same numbers on another run
    assert rows_a == rows_b
    assert_same_lora(tmp_path / "a" / "out", tmp_path / "b" / "out")
    assert (tmp_path / "a" / "out" / "lora-best.safetensors").is_file()
    best = [json.loads((tmp_path / n / "out" / "checkpoints" / "step-000005" / "state.json")
                       .read_text())["validation"] for n in "ab"]
    assert best[0] == best[1] == {"best": val[2][0], "best_step": 2, "bad": 2}
    ba, bb = (load_file(str(tmp_path / n / "out" / "lora-best.safetensors")) for n in "ab")
    assert ba.keys() == bb.keys() and all(torch.equal(ba[k], bb[k]) for k in ba)
    charts = sorted(p.name for p in (tmp_path / "a" / "out" / "validation").iterdir())
    assert charts == ["loss_by_t-000002.png", "loss_by_t-000004.png", "loss_by_t-000005.png"]


def test_early_stop_saves_and_ends_cleanly(tmp_path: Path, images: Path) -> None:
    # Two of the six images held out of training; no evaluation after the first improves
    # by 100: patience 2 stops after step 3 of 6.
    cfg = run_toml(tmp_path, images, steps=6, extra="\n[validation]\nenabled = true\n"
                   "fraction = 0.34\nevery_n_steps = 1\nearly_stop_patience = 2\n"
                   "min_delta = 100\n")
    assert train_exit_code(cfg) == 0
    out = tmp_path / "out"
    assert "validation: 2 held-out images" in (out / "difftune.log").read_text()
    assert [r["step"] for r in metrics_rows(out)] == [1, 2, 3]
    assert (out / "lora.safetensors").is_file()
    assert (out / "checkpoints" / "step-000003").is_dir()
    assert "early stop after step 3" in (out / "difftune.log").read_text()


def test_check_reports_validation_and_bad_configs_exit_2(
        tmp_path: Path, images: Path, held: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, extra=_val(held))
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "validation: on (auto: validation.path is set): 2 images" in out
    assert "one evaluation takes" in out
    losses = {}
    for kind in ("l2", "huber", "smooth_l1"):  # the loss option reaches the training step
        assert main(["check", str(cfg), "--set", f"train.loss={kind}"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "training step" in x)
        losses[kind] = float(line.split("loss ")[1].split(",")[0])
    assert len(set(losses.values())) == 3 and losses["huber"] < losses["l2"]
    bad = run_toml(tmp_path / "bad", images, extra=_val(held, enabled="false", keep_best="true"))
    assert main(["check", str(bad)]) == 2
    assert "validation.keep_best" in capsys.readouterr().err


def test_a_failing_evaluation_never_stops_training(
        tmp_path: Path, images: Path, held: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from difftune.train.validation import Validator

    def broken(self: Validator) -> None:
        raise OSError("held-out image gone")

    monkeypatch.setattr(Validator, "evaluate", broken)
    cfg = run_toml(tmp_path, images, steps=2, extra=_val(held, every_n_steps=1))
    assert train_exit_code(cfg) == 0
    assert (tmp_path / "out" / "lora.safetensors").is_file()
    assert "validation failed and is now off" in (tmp_path / "out" / "difftune.log").read_text()
