"""Qwen-Image-Edit (the Qwen-Image family's "edit" variant) through the real CLI on the tiny
flavor and the bundled edit pairs: check reports the pairs, training samples through
QwenImageEditPipeline with each prompt's input image, the LoRA loads in QwenImageEditPipeline
(which encodes the instruction with the image itself) and gives the trained model's images, a
run with reference latents and image-reading text entries in disk caches resumes exactly, and
a QwenImageEditPipeline folder is read as the edit variant; the same for "edit-plus" with two
input images per pair (QwenImageEditPlusPipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from difftune import families
from difftune.cli import main
from difftune.config import ModelConfig, PrecisionConfig
from difftune.data.images import load_rgb
from difftune.precision.policy import PrecisionPolicy

from ..conftest import assert_same_lora, metrics_rows, stopped_and_resumed
from .test_flux_kontext import DISK, EDIT, kontext_toml

VARIANT = "edit"
MODEL = f'family = "qwen_image"\nflavor = "tiny"\nvariant = "{VARIANT}"'
END_ONLY = ("sample.at_start=false", "sample.every_n_steps=4")  # sample after step 4 only


def train(folder: Path, *sets: str, **kw: object) -> Path:
    """An edit run through the CLI; its output folder."""
    args = ["train", str(kontext_toml(folder, model=MODEL, **kw)), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


SMALL_AREA = 256 * 256  # the pipelines' 1024 x 1024 input-image area, in this module
RELEASED_AREA = 1024 * 1024


@pytest.fixture(scope="module", autouse=True)
def small_input_image_area() -> Iterator[None]:
    """The edit pipelines read each input image at about 1024 x 1024 pixels whatever its
    size: the edit pipeline for its VAE and its text encoder (an inline
    `calculate_dimensions(1024 * 1024, ...)`, which difftune's text images follow by
    `edit.VAE_AREA`), the Plus pipeline for its VAE (`VAE_IMAGE_SIZE`, which difftune never
    reads). A VAE encoding at that size is most of each sampling round here (3 s on a CPU),
    so this module runs the pipelines and difftune's matching constant at 256 x 256: the
    tests compare difftune's samples with the pipelines' at the same rule and area. That the
    constants are the released 1024 x 1024 and that difftune's inputs equal the pipelines' at
    that size, tests/unit/test_qwen_image_edit.py asserts."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as one
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from difftune.families.qwen_image import edit

    real = one.calculate_dimensions

    def smaller(area: float, ratio: float) -> tuple[int, int, None]:
        return real(SMALL_AREA if area == RELEASED_AREA else area, ratio)

    assert edit.VAE_AREA == plus.VAE_IMAGE_SIZE == RELEASED_AREA
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(one, "calculate_dimensions", smaller)
        mp.setattr(plus, "VAE_IMAGE_SIZE", SMALL_AREA)
        mp.setattr(edit, "VAE_AREA", SMALL_AREA)
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, small_input_image_area: None) -> Path:
    """4 steps on the edit pairs, sampled with the bundled prompts (input images by --ci)
    once, at the end: the tests read only those samples, and each sampling round (the VAE
    encoding each input image, true CFG) costs more than the training."""
    return train(tmp_path_factory.mktemp("qedit"), *END_ONLY, prompts=EDIT / "prompts.txt")


def _pipeline() -> object:
    family = families.get("qwen_image", VARIANT)
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    pipe = family.pipeline(family.load(ModelConfig(family="qwen_image", flavor="tiny",
                                                   variant=VARIANT), policy))
    assert type(pipe).__name__ == "QwenImageEditPipeline"
    return pipe


def _sample(pipe: object, prompt: str, image: Path, width: int, height: int) -> np.ndarray:
    """What the run's sampler renders for a prompt line (defaults: seed 0, true CFG 4 with
    the empty negative prompt), the pipeline encoding the texts with the image itself."""
    out = pipe(prompt=prompt, negative_prompt="", true_cfg_scale=4.0,  # type: ignore
               image=load_rgb(image), width=width, height=height, num_inference_steps=4,
               generator=torch.Generator("cpu").manual_seed(0))
    return np.asarray(out.images[0], dtype=np.int16)


def test_check_reports_the_bundled_pairs(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    cfg = kontext_toml(tmp_path, model=MODEL, prompts=EDIT / "prompts.txt")
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "edit pairs: 4 complete" in out and "sample works" in out
    assert "control size 64x64: 4" in out  # about 64 x 64 pixels, multiples of 32


def test_samples_use_the_input_images(trained: Path) -> None:
    names = sorted(p.name for p in (trained / "samples").glob("step-000004_0*.png"))
    assert names == ["step-000004_00_make-the-circle-red.png",
                     "step-000004_01_turn-the-ring-yellow.png"]
    with Image.open(trained / "samples" / names[1]) as img:
        assert img.size == (96, 64)
    assert all(np.isfinite(r["loss"]) for r in metrics_rows(trained))


def test_lora_in_edit_pipeline_gives_the_trained_models_images(trained: Path) -> None:
    pipe = _pipeline()
    before = _sample(pipe, "make the circle red", EDIT / "before/circle.png", 64, 64)
    pipe.load_lora_weights(str(trained / "lora.safetensors"))  # type: ignore[attr-defined]
    after = _sample(pipe, "make the circle red", EDIT / "before/circle.png", 64, 64)
    with Image.open(trained / "samples/step-000004_00_make-the-circle-red.png") as img:
        ours = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert np.abs(after - ours).max() <= 1  # PNG rounding at most
    assert np.abs(before - ours).max() > 1


def test_resume_with_controls_and_disk_caches_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = kontext_toml(tmp_path / "a", model=MODEL, steps=6, extra=DISK)
    b = kontext_toml(tmp_path / "b", model=MODEL, steps=6, extra=DISK)
    rows = stopped_and_resumed(a, b, monkeypatch, 3)
    assert rows[0] == rows[1] and len(rows[0]) == 6
    assert_same_lora(tmp_path / "a" / "out", tmp_path / "b" / "out")
    files = list((tmp_path / "a").rglob("*.safetensors"))
    assert len([p for p in files if "latents" in p.parts]) == 8  # 4 targets, 4 references
    # one text entry per (instruction, input image): the 4 pairs' captions are distinct
    assert len([p for p in files if "text" in p.parts]) == 4


def test_an_edit_diffusers_folder_is_read_as_edit(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """model.path alone: the folder's model_index.json (QwenImageEditPipeline) picks the
    variant, and its processor/ is read."""
    folder = tmp_path / "tiny-edit"
    _pipeline().save_pretrained(str(folder), safe_serialization=True)  # type: ignore[attr-defined]
    cfg = kontext_toml(tmp_path, model=f'family = "qwen_image"\npath = "{folder.as_posix()}"')
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "edit pairs: 4 complete" in out and "check passed" in out


PLUS = 'family = "qwen_image"\nflavor = "tiny"\nvariant = "edit-plus"'


def plus_toml(folder: Path, **kw: object) -> Path:
    """An edit-plus run on the bundled pairs with two input images each: before/ and a
    mirrored copy of it (control_path lists both folders)."""
    mirrored = folder / "mirrored"
    mirrored.mkdir(parents=True, exist_ok=True)
    for image in (EDIT / "before").glob("*.png"):
        with Image.open(image) as img:
            img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(mirrored / image.name)
    path = kontext_toml(folder, model=PLUS, **kw)
    one = f'control_path = "{(EDIT / "before").as_posix()}"'
    text = path.read_text(encoding="utf-8")
    assert one in text
    two = (f'control_path = ["{(EDIT / "before").as_posix()}", '
           f'"{mirrored.as_posix()}"]')
    path.write_text(text.replace(one, two), encoding="utf-8")
    return path


def test_edit_plus_trains_and_its_lora_gives_the_trained_models_images(tmp_path: Path) -> None:
    """Two input images per pair: samples through QwenImageEditPlusPipeline with both, and the
    LoRA loaded there (the pipeline encoding the texts with both images) gives them."""
    prompts = tmp_path / "prompts.txt"
    circle = [EDIT / "before/circle.png", tmp_path / "mirrored/circle.png"]
    prompts.write_text(f"make the circle red --ci {circle[0].as_posix()} "
                       f"--ci {circle[1].as_posix()} --w 64 --h 64 --s 4\n", encoding="utf-8")
    cfg = plus_toml(tmp_path, prompts=prompts)
    sets = [a for s in END_ONLY for a in ("--set", s)]
    assert main(["train", str(cfg), "--no-progress", *sets]) == 0
    out = tmp_path / "out"
    family = families.get("qwen_image", "edit-plus")
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    pipe = family.pipeline(family.load(ModelConfig(family="qwen_image", flavor="tiny",
                                                   variant="edit-plus"), policy))
    assert type(pipe).__name__ == "QwenImageEditPlusPipeline"
    pipe.load_lora_weights(str(out / "lora.safetensors"))  # type: ignore[attr-defined]
    result = pipe(prompt="make the circle red", negative_prompt="",  # type: ignore[operator]
                  true_cfg_scale=4.0, image=[load_rgb(p) for p in circle], width=64, height=64,
                  num_inference_steps=4, generator=torch.Generator("cpu").manual_seed(0))
    with Image.open(out / "samples/step-000004_00_make-the-circle-red.png") as img:
        ours = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert np.abs(np.asarray(result.images[0], dtype=np.int16) - ours).max() <= 1
    assert all(np.isfinite(r["loss"]) for r in metrics_rows(out))


@pytest.mark.full_only  # the "edit" variant's exact-resume case runs by default
def test_edit_plus_resume_with_disk_caches_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = plus_toml(tmp_path / "a", steps=4, extra=DISK)
    b = plus_toml(tmp_path / "b", steps=4, extra=DISK)
    rows = stopped_and_resumed(a, b, monkeypatch, 2)
    assert rows[0] == rows[1] and len(rows[0]) == 4
    files = list((tmp_path / "a").rglob("*.safetensors"))
    assert len([p for p in files if "latents" in p.parts]) == 12  # 4 targets, 8 references
    assert len([p for p in files if "text" in p.parts]) == 4  # one per instruction+images
