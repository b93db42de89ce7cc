"""A step-distilled base (FLUX.1 schnell, Z-Image-Turbo, Krea 2 Turbo) is told apart from its weights or
config, never its file names, and `check` (like train and cache, which share the loading) warns
what training it does and what to train on instead, in the words of the family's spec."""

from __future__ import annotations

from pathlib import Path

import pytest
from diffusers import FluxPipeline, FluxTransformer2DModel

from difftune.cli import main
from difftune.families.flux.spec import BASE
from difftune.families.flux.tiny import build_tiny_flux
from tests.e2e.conftest import run_toml


def test_check_warns_on_schnell_and_not_on_dev(tmp_path: Path, images: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    parts = {k: v for k, v in build_tiny_flux().items() if k != "t5_max_length"}
    dev = parts["transformer"]
    parts["transformer"] = FluxTransformer2DModel.from_config(
        {**dict(dev.config), "guidance_embeds": False})  # schnell: no guidance embedding
    FluxPipeline(**parts).save_pretrained(str(tmp_path / "schnell"), safe_serialization=True)
    schnell = run_toml(tmp_path / "a", images,
                       model=f'path = "{(tmp_path / "schnell").as_posix()}"')
    assert main(["check", str(schnell)]) == 0
    said = "".join(capsys.readouterr())
    assert f"distilled base: {BASE.distilled_note}" in said
    assert "check passed" in said
    assert main(["check", str(run_toml(tmp_path / "b", images))]) == 0  # the tiny FLUX.1-dev
    assert "distilled base" not in "".join(capsys.readouterr())


def test_check_warns_on_krea2_turbo(tmp_path: Path, images: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Krea 2 Turbo: the folder's model_index.json declares is_distilled."""
    from diffusers import Krea2Pipeline

    from difftune.families.krea2.spec import SPEC
    from difftune.families.krea2.tiny import build_tiny_krea2

    Krea2Pipeline(**build_tiny_krea2(), is_distilled=True).save_pretrained(
        str(tmp_path / "turbo"), safe_serialization=True)
    cfg = run_toml(tmp_path / "a", images, family="krea2",
                   model=f'path = "{(tmp_path / "turbo").as_posix()}"')
    assert main(["check", str(cfg)]) == 0
    assert f"distilled base: {SPEC.distilled_note}" in "".join(capsys.readouterr())


def _z_image_turbo(folder: Path) -> Path:
    """The tiny Z-Image saved as Turbo: the same weights, Turbo's scheduler (shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from difftune.families.z_image.files import TURBO_SCHEDULER_CONFIG
    from difftune.families.z_image.tiny import build_tiny_z_image

    parts = {**build_tiny_z_image(),
             "scheduler": FlowMatchEulerDiscreteScheduler(**TURBO_SCHEDULER_CONFIG)}
    ZImagePipeline(**parts).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_check_tells_z_image_turbo_from_base_by_its_scheduler(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Turbo's folder (scheduler shift 3) is warned about; Base's (the tiny flavor, shift 6) is
    not; single files over a folder without scheduler/ say the release is assumed, and how to
    say it is Base."""
    import shutil

    from difftune.families.z_image.files import SCHEDULER_UNKNOWN
    from difftune.families.z_image.spec import SPEC

    turbo = _z_image_turbo(tmp_path / "turbo")
    cfg = run_toml(tmp_path / "a", images, family="z_image", model=f'path = "{turbo.as_posix()}"')
    assert main(["check", str(cfg)]) == 0
    said = "".join(capsys.readouterr())
    assert f"distilled base: {SPEC.distilled_note}" in said and SCHEDULER_UNKNOWN not in said
    assert main(["check", str(run_toml(tmp_path / "b", images, family="z_image"))]) == 0
    assert "distilled base" not in "".join(capsys.readouterr())
    shutil.rmtree(turbo / "scheduler")  # as a folder kept only for ComfyUI's single files
    cfg = run_toml(tmp_path / "c", images, family="z_image", model=f'path = "{turbo.as_posix()}"')
    assert main(["check", str(cfg)]) == 0
    said = "".join(capsys.readouterr())
    assert SCHEDULER_UNKNOWN in said and f"distilled base: {SPEC.distilled_note}" in said
