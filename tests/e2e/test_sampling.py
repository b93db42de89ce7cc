"""Sampling through the real CLI: a prompt file edited mid-run by another thread, unloaded text
encoders reloaded only for new text, training unchanged by sampling, and `difftune sample`."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.cli import main
from difftune.families.flux.family import FluxFamily
from difftune.sample.runner import SampleRunner

from .conftest import run_toml

ORIGINAL = "a red circle --w 32 --h 32 --s 1 --d 1\na pink ring --w 32 --h 32 --s 1 --d 2\n"
NEW = "a green square --w 32 --h 32 --s 1 --d 3"


def edited_run(tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
               caplog: pytest.LogCaptureFixture, sets: list[str]) -> tuple[Path, Path, int]:
    """Train 8 steps sampling every step while another thread edits the prompt file after
    each of the first four events: add a prompt, break a line, empty the file, restore it.
    Returns (output folder, prompt file, text-encoder reloads)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(ORIGINAL, encoding="utf-8")
    edits: list[Callable[[], None]] = [
        lambda: prompts.write_text(ORIGINAL + NEW + "\n", encoding="utf-8"),
        lambda: prompts.write_text(ORIGINAL + NEW + "\na broken line --x 3\n", encoding="utf-8"),
        lambda: prompts.write_text("", encoding="utf-8"),
        lambda: prompts.write_text(ORIGINAL + NEW + "\n", encoding="utf-8"),
    ]
    events: list[threading.Event] = []
    ready = threading.Condition()
    real_run = SampleRunner.run

    def run(self: SampleRunner, step: int, *args: object, **kwargs: object) -> list[Path]:
        out = real_run(self, step, *args, **kwargs)
        if len(events) < len(edits):  # hand the file to the editor thread, wait for its edit
            done = threading.Event()
            with ready:
                events.append(done)
                ready.notify()
            assert done.wait(30), "the editor thread did not answer"
        return out

    def editor() -> None:
        for i, edit in enumerate(edits):
            with ready:
                ready.wait_for(lambda: len(events) > i, timeout=60)
            edit()
            events[i].set()

    reloads = [0]
    real_reload = FluxFamily.load_text_encoders

    def counting(self: FluxFamily, *a: object) -> object:
        reloads[0] += 1
        return real_reload(self, *a)

    monkeypatch.setattr(SampleRunner, "run", run)
    monkeypatch.setattr(FluxFamily, "load_text_encoders", counting)
    cfg = run_toml(tmp_path, images, steps=8, prompts=prompts)
    cfg.write_text(cfg.read_text().replace("every_n_steps = 2", "every_n_steps = 1"))
    thread = threading.Thread(target=editor, daemon=True)
    thread.start()
    args = ["train", str(cfg), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert main(args) == 0
    thread.join(10)
    assert not thread.is_alive() and all(e.is_set() for e in events)
    return tmp_path / "out", prompts, reloads[0]


def _check_edits(out: Path, prompts: Path, caplog: pytest.LogCaptureFixture) -> None:
    names = sorted(p.name for p in (out / "samples").glob("step-*.png") if "grid" not in p.name)
    steps_with = lambda word: sorted({int(n[5:11]) for n in names if word in n})  # noqa: E731
    assert steps_with("green-square") == [1, 2, 4, 5, 6, 7, 8]  # added after event 0
    assert steps_with("red-circle") == [0, 1, 2, 4, 5, 6, 7, 8]  # none at 3: the file was empty
    assert f"{prompts}:4: skipped prompt line: unknown option --x" in caplog.text
    assert f"sample prompt file {prompts} holds no prompts" in caplog.text
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))


def test_prompt_file_edited_mid_run_with_disk_cache_and_unloaded_encoders(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    out, prompts, reloads = edited_run(
        tmp_path, images, monkeypatch, caplog,
        ['cache.text="disk"', 'cache.latents="disk"', "cache.unload_text_encoders=true"])
    _check_edits(out, prompts, caplog)
    assert reloads == 1  # once, for the added prompt; the restored file was already cached


def test_prompt_file_edited_mid_run_without_text_caching(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    out, prompts, reloads = edited_run(tmp_path, images, monkeypatch, caplog,
                                       ['cache.text="none"'])
    _check_edits(out, prompts, caplog)
    assert reloads == 0


def test_unload_needs_cached_text(tmp_path: Path, images: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    assert main(["check", str(cfg), "--set", 'cache.text="none"', "--set",
                 "cache.unload_text_encoders=true"]) == 2
    assert "cache.unload_text_encoders needs cached text" in capsys.readouterr().err


def test_sampling_does_not_change_training(tmp_path: Path, images: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text(ORIGINAL + "a blue thing --w 48 --h 32 --s 2 --l 3 --n dark\n")
    losses, loras = [], []
    for name, kw in (("with", {"prompts": prompts}), ("without", {})):
        folder = tmp_path / name
        folder.mkdir()
        assert main(["train", str(run_toml(folder, images, steps=6, **kw)), "--no-progress"]) == 0
        rows = (folder / "out" / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(r)["loss"] for r in rows])
        loras.append(load_file(str(folder / "out" / "lora.safetensors")))
    assert list((tmp_path / "with" / "out" / "samples").glob("step-000004_*"))
    assert losses[0] == losses[1]  # bitwise: sampling left every RNG and module as it was
    assert loras[0].keys() == loras[1].keys()
    assert all(torch.equal(loras[0][k], loras[1][k]) for k in loras[0])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    folder = tmp_path_factory.mktemp("samplelora")
    cfg = run_toml(folder, images, steps=4)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    (folder / "p.toml").write_text('[[prompts]]\nprompt = "a red circle"\nwidth = 32\n'
                                   'height = 32\nsteps = 2\nseed = 5\n')
    return folder


def _sample(folder: Path, out: str, *loras: str) -> np.ndarray:
    args = ["sample", str(folder / "run.toml"), "--prompts", str(folder / "p.toml"),
            "--out", str(folder / out)] + [a for lora in loras for a in ("--lora", lora)]
    assert main(args) == 0
    pngs = sorted((folder / out).glob("sample-*_00_a-red-circle.png"))
    assert len(pngs) == 1
    return np.asarray(Image.open(pngs[0]), dtype=np.int16)


def test_sample_verb_with_loras_and_weights(lora_run: Path) -> None:
    lora = str(lora_run / "out" / "lora.safetensors")
    base = _sample(lora_run, "base")
    full = _sample(lora_run, "full", lora)
    zero = _sample(lora_run, "zero", f"{lora}:0")
    half = _sample(lora_run, "half", f"{lora}:0.5")
    assert np.abs(full - base).max() > 0
    assert np.array_equal(zero, base)  # weight 0: the LoRA does nothing
    assert 0 < np.abs(half - base).mean() < np.abs(full - base).mean()


def test_sample_verb_refuses_bad_lora_files(lora_run: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(lora_run / "run.toml")
    assert main(["sample", cfg, "--lora", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "x.ckpt").write_bytes(b"pickle")
    assert main(["sample", cfg, "--lora", str(tmp_path / "x.ckpt")]) == 2
    assert "pickle" in capsys.readouterr().err


def test_a_one_step_qwen_image_sample_is_not_nan(tmp_path: Path, images: Path) -> None:
    """Qwen-Image's scheduler (shift_terminal) gave a one-step schedule NaN sigmas ("invalid
    value encountered in divide"): the sample was NaN, written as a black image. Now finite."""
    import warnings

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 1\n")
    cfg = run_toml(tmp_path, images, family="qwen_image", fmt=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["sample", str(cfg), "--prompts", str(prompts), "--out",
                     str(tmp_path / "pics")]) == 0
    assert not [w for w in seen if "invalid value" in str(w.message)], seen
    (png,) = (tmp_path / "pics").glob("*_00_a-red-circle.png")
    pixels = np.asarray(Image.open(png))
    assert pixels.max() > pixels.min()  # a picture, not the all-black cast of NaN
