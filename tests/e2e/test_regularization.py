"""Regularization subsets and output preservation through the real CLI on tiny FLUX.1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from difftune.cli import main
from tests.e2e.conftest import metrics_rows, run_toml, stopped_and_resumed

TRIGGER = "zqx"


CLASS = 'class_prompt = "a shape"\nclass_images = 3\nclass_steps = 2\n'


@pytest.fixture(scope="module")
def folders(images: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Three images captioned with the trigger (training); one of the user's own, named like
    a generated one, in the regularization folder (class images complete it)."""
    root = tmp_path_factory.mktemp("reg")
    train, reg = root / "train", root / "reg"
    train.mkdir(), reg.mkdir()
    for n, png in enumerate(sorted(images.glob("*.png"))[:4]):
        caption = png.with_suffix(".txt").read_text().strip()
        folder, name = (train, png.stem) if n < 3 else (reg, "class_000000")
        shutil.copy(png, folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"{TRIGGER} {caption}" if n < 3 else caption)
    return train, reg


def reg_toml(folder: Path, train: Path, reg: Path, extra: str = "", steps: int = 4,
             subset: str = CLASS, family: str | None = None) -> Path:
    """A tiny-flavor run over a training subset and a regularization subset."""
    path = run_toml(folder, train, steps=steps, family=family, fmt=None if family else "diffusers")
    text = path.read_text().replace(f'path = "{train.as_posix()}"\n', "", 1)
    path.write_text(text + f"""
[[datasets.subsets]]
path = "{train.as_posix()}"

[[datasets.subsets]]
path = "{reg.as_posix()}"
regularization = true
prior_loss_weight = 0.5
repeats = 2
{subset}{extra}""")
    return path


def test_regularization_and_preservation_train_and_resume_exactly(
        tmp_path: Path, folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    extra = f'\n[preservation]\ntrigger = "{TRIGGER}"\nweight = 2.0\n'
    a, b = (reg_toml(tmp_path / n, *folders, extra=extra) for n in "ab")
    reg = folders[1]
    user = (reg / "class_000000.png").read_bytes()
    full, resumed = stopped_and_resumed(a, b, monkeypatch, 2)
    assert full == resumed
    # The first run generated the two missing class images, around the user's own file; the
    # later runs reused them (the manifest names two files, none was rewritten).
    manifest = json.loads((reg / "difftune_class_images.json").read_text())
    assert sorted(manifest["files"]) == ["class_000001.png", "class_000002.png"]
    assert (reg / "class_000000.png").read_bytes() == user
    assert (reg / "class_000001.txt").read_text().strip() == "a shape"
    assert len(list(reg.glob("*.png"))) == 3
    rows = [metrics_rows(cfg.parent / "out") for cfg in (a, b)]
    kept = [[r.get("loss_preservation") for r in run] for run in rows]
    assert kept[0] == kept[1]
    assert any(v is not None and v > 0 for v in kept[0])  # steps with a trigger caption
    # Balanced: 3 training + 3 regularization samples (of the 6 its repeats = 2 give) per
    # epoch make 3 batches of 2; unbalanced, the 9 samples would make 5.
    assert [r["epoch"] for r in rows[0]] == [0, 0, 0, 1]


def test_refusals_name_the_field(tmp_path: Path, folders: tuple[Path, Path],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = reg_toml(tmp_path, *folders, extra=f'\n[preservation]\ntrigger = "{TRIGGER}"\n')
    assert main(["train", str(cfg), "--no-progress", "--set", 'adapter.type="full"']) == 2
    assert "preservation.trigger" in capsys.readouterr().err
    assert main(["train", str(cfg), "--no-progress", "--set", "preservation.weight=0"]) == 2
    assert "preservation.weight" in capsys.readouterr().err
    no_prompt = reg_toml(tmp_path / "np", *folders, subset="class_images = 3\n")
    assert main(["train", str(no_prompt), "--no-progress"]) == 2
    assert "class_prompt" in capsys.readouterr().err
    only = run_toml(tmp_path / "only", folders[1])
    only.write_text(only.read_text().replace("resolution = 64", "resolution = 64\n"
                                             "regularization = true", 1))
    assert main(["train", str(only), "--no-progress"]) == 2
    assert "regularization" in capsys.readouterr().err


def _fresh(tmp_path: Path, images: Path) -> tuple[Path, Path]:
    """Three trigger-captioned training images and an empty regularization folder."""
    train, reg = tmp_path / "train", tmp_path / "reg"
    train.mkdir(), reg.mkdir()
    for png in sorted(images.glob("*.png"))[:3]:
        shutil.copy(png, train / png.name)
        (train / f"{png.stem}.txt").write_text(f"{TRIGGER} {png.stem}")
    return train, reg


@pytest.mark.parametrize("manifest", ['["class_000000.png"]',
                                      '{"settings": {}, "files": ["class_000000.png"]}',
                                      '{"settings": {}, "files": {"class_000000.png": "x"}}'])
def test_a_manifest_of_another_shape_is_refused(tmp_path: Path, images: Path, manifest: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest that is a list, or whose `files` is not a mapping of names to seeds, was an
    AttributeError traceback; now exit 2 naming the file, before anything is generated."""
    train, reg = _fresh(tmp_path, images)
    (reg / "difftune_class_images.json").write_text(manifest)
    for verb in ("check", "train"):
        assert main([verb, str(reg_toml(tmp_path, train, reg))]) == 2
        err = capsys.readouterr().err
        assert f"error: {reg / 'difftune_class_images.json'} is not a class-image manifest" in err
        assert "Traceback" not in err
    assert not list(reg.glob("class_*"))


def test_class_images_cut_short_by_a_kill_are_made_again(tmp_path: Path, images: Path) -> None:
    """Images the manifest names that a kill left empty or truncated are generated again, as
    they were, instead of being skipped as unreadable."""
    train, reg = _fresh(tmp_path, images)
    cfg = reg_toml(tmp_path, train, reg, steps=1)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    made = {p.name: p.read_bytes() for p in sorted(reg.glob("class_*.png"))}
    assert len(made) == 3
    (reg / "class_000000.png").write_bytes(b"")
    (reg / "class_000002.png").write_bytes(made["class_000002.png"][:100])
    assert main(["train", str(cfg), "--no-progress", "--set", "save.overwrite=true"]) == 0
    assert {p.name: p.read_bytes() for p in sorted(reg.glob("class_*.png"))} == made
    assert not list(reg.glob(".*"))  # no temporary file left


def test_a_kill_while_a_class_image_is_written_leaves_no_partial_file(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt in the middle of writing the second image: the first is whole, no file of
    the second exists (a rerun makes it), nothing half-written under a class image's name."""
    from PIL import Image

    train, reg = _fresh(tmp_path, images)
    real, calls = Image.Image.save, []

    def cut(self: Image.Image, fp: object, *args: object, **kw: object) -> None:
        calls.append(fp)
        if len(calls) == 2:  # the kill arrives after the first bytes of the second image
            (open(fp, "wb") if isinstance(fp, (str, Path)) else fp).write(b"\x89PNG")
            raise KeyboardInterrupt
        real(self, fp, *args, **kw)

    monkeypatch.setattr(Image.Image, "save", cut)
    cfg = reg_toml(tmp_path, train, reg, steps=1)
    assert main(["train", str(cfg), "--no-progress"]) == 130
    monkeypatch.setattr(Image.Image, "save", real)
    assert sorted(p.name for p in reg.iterdir() if p.suffix == ".png") == ["class_000000.png"]
    assert main(["train", str(cfg), "--no-progress", "--set", "save.overwrite=true"]) == 0
    assert len(list(reg.glob("class_*.png"))) == 3


def test_one_step_class_images_of_qwen_image_are_pictures(tmp_path: Path, images: Path) -> None:
    """class_steps = 1 on Qwen-Image gave NaN images (its scheduler's one-step schedule),
    written as black PNGs that trained as the class."""
    train, reg = _fresh(tmp_path, images)
    subset = CLASS.replace("class_steps = 2", "class_steps = 1")
    cfg = reg_toml(tmp_path, train, reg, steps=1, subset=subset, family="qwen_image")
    assert main(["train", str(cfg), "--no-progress"]) == 0
    made = sorted(reg.glob("class_*.png"))
    assert len(made) == 3
    for png in made:
        pixels = np.asarray(Image.open(png))
        assert pixels.max() > pixels.min(), png
