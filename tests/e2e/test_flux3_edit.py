"""FLUX.3 edit pairs through the real CLI on the tiny flavor and the bundled pairs (one
reference each): check reports the pairs and the canvases the references are kept whole on,
and a run trains on them and samples with the prompts' --ci images through the modular
pipeline's image-conditioned path."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftune.cli import main
from difftune.verbs.demo import demo_dir

from .conftest import run_toml

EDIT = demo_dir().parent / "edit"


def edit_toml(folder: Path, prompts: Path | None = None) -> Path:
    """`run_toml` for FLUX.3 on the bundled pairs (after/ targets, before/ references)."""
    path = run_toml(folder, EDIT / "after", family="flux3", prompts=prompts, steps=2)
    target = f'path = "{(EDIT / "after").as_posix()}"\n'
    text = path.read_text(encoding="utf-8")
    control = f'control_path = "{(EDIT / "before").as_posix()}"\n'
    path.write_text(text.replace(target, target + control), encoding="utf-8")
    return path


@pytest.mark.full_only  # the run below trains on the same pairs by default
def test_check_reports_the_pairs_and_canvases(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(edit_toml(tmp_path / "run"))]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "edit pairs: 4 complete" in out
    # resolution 64: a canvas holds up to 4 x 64^2 pixels, so the references stay whole
    for line in ("control size 64x64: 2", "control size 64x96: 1", "control size 96x64: 1"):
        assert line in out


def test_an_edit_run_trains_and_samples_with_its_references(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"make the circle red --ci {(EDIT / 'before/circle.png').as_posix()} "
                       "--w 64 --h 64 --s 2\n", encoding="utf-8")
    cfg = edit_toml(tmp_path / "run", prompts)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "run" / "out"
    assert (out / "lora.safetensors").is_file()
    assert sorted(p.name for p in (out / "samples").glob("step-000002_0*.png")) == [
        "step-000002_00_make-the-circle-red.png"]
