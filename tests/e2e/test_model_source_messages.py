"""Each family's model-source messages and help name its own files, through the real CLI: a
ComfyUI single file without the folder names the folder and tokenizer that family needs and the
single files it reads, never another family's (no CLIP-L or T5 for Z-Image or Qwen-Image)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from difftune.cli import main
from difftune.config import ModelConfig
from difftune.families import registry

from .conftest import run_toml

KINDS = [(name, variant) for name in registry.names()
         for variant, _ in registry.variant_specs(name)]
SINGLE_KEYS = ("transformer", "vae", "clip_l", "t5", "text_encoder")


def _model_lines(family: str, variant: str | None, lines: list[str]) -> str:
    """The [model] lines of a run file: `family`, `variant`, and `lines`."""
    head = f'family = "{family}"' + (f'\nvariant = "{variant}"' if variant else "")
    return "\n".join([head, *lines])


@pytest.mark.parametrize(("family", "variant"), KINDS)
def test_single_file_without_folder_names_the_familys_own_files(
        tmp_path: Path, images: Path, family: str, variant: str | None,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, model=_model_lines(
        family, variant, ['transformer = "/models/my-transformer.safetensors"']))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    files = registry.spec(family, variant).files
    assert "Traceback" not in err
    # Every single file the family reads, with its released file name, and its folder layout.
    for key, what in files.singles:
        assert f"model.{key} ({what})" in err, (key, err)
    assert files.folder in err
    if files.folder_holds is not None:
        assert "model.path is not set" in err and files.folder_holds in err
    else:
        assert "all of" in err and "missing: model.vae" in err
    # Never a file of another family's.
    for key in SINGLE_KEYS:
        if key not in files.keys:
            assert f"model.{key}" not in err, (key, err)


@pytest.mark.parametrize("family", ["z_image", "qwen_image"])
def test_a_file_the_family_does_not_read_is_refused(tmp_path: Path, images: Path, family: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, model=_model_lines(
        family, None, [f'path = "{tmp_path.as_posix()}"',
                       'clip_l = "/models/clip_l.safetensors"',
                       't5 = "/models/t5xxl_fp16.safetensors"']))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    for key in ("clip_l", "t5"):
        assert f'model.{key}: model.family = "{family}"' in err, err
    assert err.count("reads no such file") == 2
    assert "model.transformer, model.vae, model.text_encoder); remove it" in err


@pytest.mark.parametrize(("family", "variant"), KINDS)
def test_a_path_that_is_no_folder_names_the_familys_layout(
        tmp_path: Path, images: Path, family: str, variant: str | None,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, model=_model_lines(
        family, variant, [f'path = "{(tmp_path / "no-such-folder").as_posix()}"']))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "no-such-folder is not a folder" in err
    assert f"in the {registry.spec(family, variant).files.folder} layout" in err


def _whole_file(family: str, path: Path) -> Path:
    """`family`'s tiny denoiser saved as the single file its users give: a UNet family's in
    the original checkpoint's layout (as sd_xl_base_1.0.safetensors), others' as diffusers'."""
    from tests.ui.test_models import _denoiser, _tiny
    from tests.unit.test_sd_files import to_sgm_unet

    tiny = _tiny(family, None)
    save_file(to_sgm_unet(tiny["unet"]) if "unet" in tiny else _denoiser(tiny), str(path))
    return path


# (the file's family, the run file's model.family, what the error must say)
FAMILY_CHECKS = [
    ("sdxl", None, ['"sdxl"', 'add model.family = "sdxl"', "never guessed", '"flux"']),
    ("sd15", "sdxl", ['"sd15" denoiser', 'not model.family = "sdxl"', 'model.family = "sd15"']),
    ("flux", None, ["FLUX.1-dev", "missing: model.vae"]),  # FLUX.1's file: today's message
]


@pytest.mark.parametrize(("shows", "family", "said"), FAMILY_CHECKS)
def test_a_file_of_another_family_is_refused_never_guessed(
        tmp_path: Path, images: Path, shows: str, family: str | None, said: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """A single denoiser file whose tensors are another family's than model.family (or than
    the default FLUX.1, when the run file names no family) is refused naming the file, the
    family its tensors show and the line to write; the family is not switched silently."""
    path = _whole_file(shows, tmp_path / "model.safetensors")
    line = [f'family = "{family}"'] if family else []
    cfg = run_toml(tmp_path, images, model="\n".join([*line, f'transformer = "{path.as_posix()}"']))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for text in said:
        assert text in err, (text, err)
    wrong = shows != (family or "flux")
    assert (str(path) in err and "model.vae" not in err) == wrong, err  # not FLUX's file list


def test_help_names_every_familys_folder_and_files() -> None:
    fields = ModelConfig.model_fields
    for name, variant in KINDS:
        files = registry.spec(name, variant).files
        assert files.folder in (fields["path"].description or "")
        for key, what in files.singles:
            assert what in (fields[key].description or ""), (name, key)
    # No family's files are offered under a key it does not read.
    assert "z_image" not in (fields["clip_l"].description or "")
    assert "qwen_image" not in (fields["t5"].description or "")
