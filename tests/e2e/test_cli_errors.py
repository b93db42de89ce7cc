"""Bad input through the real CLI: clear one-paragraph errors, warnings naming files, exit codes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from difftune.cli import main

from .conftest import run_toml


def test_config_error_is_one_message_without_traceback(tmp_path: Path, images: Path) -> None:
    cfg = run_toml(tmp_path, images)
    cfg.write_text(cfg.read_text().replace("steps = 4", "steps = 4\nwarmup = 3"))
    proc = subprocess.run([sys.executable, "-m", "difftune", "train", str(cfg)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "train.warmup" in proc.stderr and "unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_folder_without_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    assert main(["check", str(run_toml(tmp_path, empty))]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "no usable image" in err.lower()


def test_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(run_toml(tmp_path, tmp_path / "nope")), "--no-progress"]) == 2
    assert "nope" in capsys.readouterr().err


def test_bad_files_are_skipped_and_listed_by_check(tmp_path: Path, images: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    shutil.copytree(images, data)
    good = (data / "red_circle.png").read_bytes()
    (data / "truncated.png").write_bytes(good[: len(good) // 2])
    (data / "corrupt.jpg").write_bytes(b"not a jpeg at all")
    (data / "empty.webp").write_bytes(b"")
    (data / "pink_ring.txt").unlink()  # a missing caption
    code = main(["check", str(run_toml(tmp_path, data))])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("truncated.png", "corrupt.jpg", "empty.webp"):
        assert name in out and name in caplog.text
    assert "pink_ring.png" in caplog.text and "caption" in caplog.text
    assert "6 images, 3 skipped, 1 without caption" in out
    assert "training step: loss" in out and "check passed" in out


def test_pickle_model_file_refused(tmp_path: Path, images: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("flux.ckpt", "ae.safetensors", "clip_l.safetensors", "t5.safetensors"):
        (tmp_path / name).write_bytes(b"\x80\x04placeholder")
    cfg = run_toml(tmp_path, images)
    cfg.write_text(cfg.read_text().replace('flavor = "tiny"', "\n".join([
        f'transformer = "{(tmp_path / "flux.ckpt").as_posix()}"',
        f'vae = "{(tmp_path / "ae.safetensors").as_posix()}"',
        f'clip_l = "{(tmp_path / "clip_l.safetensors").as_posix()}"',
        f't5 = "{(tmp_path / "t5.safetensors").as_posix()}"'])))
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.transformer" in err and "flux.ckpt" in err and "arbitrary code" in err


def test_output_folder_with_a_lora_is_not_overwritten(tmp_path: Path, images: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    out = tmp_path / "out"
    out.mkdir()
    (out / "lora.safetensors").write_bytes(b"precious")
    assert main(["train", str(cfg), "--no-progress"]) == 2
    assert "save.overwrite" in capsys.readouterr().err
    assert (out / "lora.safetensors").read_bytes() == b"precious"


def test_check_passes_and_says_what_it_verified(tmp_path: Path, images: Path, prompts: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(run_toml(tmp_path, images, prompts=prompts))]) == 0
    out = capsys.readouterr().out
    for part in ("config: valid", "dataset: 6 images", "model: difftune/tiny-flux",
                 "training step: loss", "sampling: 2 prompt(s) read", "check passed"):
        assert part in out
    assert not (tmp_path / "out" / "samples").exists()


def test_sampling_failure_never_stops_training(tmp_path: Path, images: Path, prompts: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from difftune.families.flux.family import FluxFamily

    def broken(self: FluxFamily, comps: object) -> object:
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(FluxFamily, "pipeline", broken)
    cfg = run_toml(tmp_path, images, prompts=prompts)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    assert (tmp_path / "out" / "lora.safetensors").is_file()
    assert "at step 2 failed" in caplog.text and "training goes on" in caplog.text
    log_file = (tmp_path / "out" / "difftune.log").read_text()
    assert "Traceback" in log_file and "out of memory (simulated)" in log_file


def test_console_script_and_module_agree() -> None:
    import shutil

    from difftune import __version__

    script = shutil.which("difftune", path=str(Path(sys.executable).parent))
    assert script, "the `difftune` console script is not installed beside this Python"
    for cmd in ([script, "--version"], [sys.executable, "-m", "difftune", "--version"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == f"difftune {__version__}"
