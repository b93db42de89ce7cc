"""FLUX.1 Kontext (the FLUX.1 family's "kontext" variant) through the real CLI on the tiny
flavor and the bundled edit pairs: check reports the pairs, training samples through
FluxKontextPipeline with each prompt's input image, the LoRA (diffusers and kohya layouts)
loads in FluxKontextPipeline and gives the trained model's images, and a run with control
latents in disk caches resumes exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune import families
from difftune.cli import main
from difftune.config import ModelConfig, PrecisionConfig
from difftune.data.images import load_rgb
from difftune.precision.policy import PrecisionPolicy
from difftune.verbs.demo import demo_dir

from ..conftest import (
    assert_same_lora,
    metrics_rows,
    run_toml,
    stopped_and_resumed,
)
from .test_flux import DOUBLE_BLOCKS

EDIT = demo_dir().parent / "edit"
KONTEXT = 'family = "flux"\nflavor = "tiny"\nvariant = "kontext"'
DISK = '\n[cache]\nlatents = "disk"\ntext = "disk"\n'


def kontext_toml(folder: Path, model: str = KONTEXT, **kw: object) -> Path:
    """`run_toml` on the bundled edit pairs (after/ trained, before/ their controls)."""
    path = run_toml(folder, EDIT / "after", model=model, **kw)  # type: ignore[arg-type]
    target = f'path = "{(EDIT / "after").as_posix()}"\n'
    text = path.read_text(encoding="utf-8")
    assert target in text
    path.write_text(text.replace(target, target + f'control_path = '
                                 f'"{(EDIT / "before").as_posix()}"\n'), encoding="utf-8")
    return path


def train(folder: Path, *sets: str, **kw: object) -> Path:
    """A Kontext run through the CLI; its output folder."""
    args = ["train", str(kontext_toml(folder, **kw)), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps on the edit pairs, sampled with the bundled prompts (input images by --ci)."""
    return train(tmp_path_factory.mktemp("kontext"), prompts=EDIT / "prompts.txt")


def _pipeline() -> object:
    family = families.get("flux", "kontext")
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    pipe = family.pipeline(family.load(ModelConfig(family="flux", flavor="tiny",
                                                   variant="kontext"), policy))
    assert type(pipe).__name__ == "FluxKontextPipeline"
    return pipe


def _sample(pipe: object, prompt: str, image: Path, width: int, height: int) -> np.ndarray:
    """What the run's sampler renders for a prompt line (defaults: seed 0, guidance 3.5)."""
    inputs = families.get("flux", "kontext").pipeline_images([load_rgb(image)], width, height)
    out = pipe(prompt=prompt, width=width, height=height, num_inference_steps=4,  # type: ignore
               guidance_scale=3.5, generator=torch.Generator("cpu").manual_seed(0),
               max_sequence_length=32, **inputs)
    return np.asarray(out.images[0], dtype=np.int16)


def test_check_reports_the_bundled_pairs(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(kontext_toml(tmp_path, prompts=EDIT / "prompts.txt"))]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "edit pairs: 4 complete" in out and "sample works" in out
    # at resolution 64: Kontext's preferred sizes scaled by 64/1024, multiples of 16
    assert "control size 64x64: 2" in out and "control size 64x48: 1" in out


def test_samples_use_the_input_images(trained: Path) -> None:
    names = sorted(p.name for p in (trained / "samples").glob("step-000004_0*.png"))
    assert names == ["step-000004_00_make-the-circle-red.png",
                     "step-000004_01_turn-the-ring-yellow.png"]
    with Image.open(trained / "samples" / names[1]) as img:
        assert img.size == (96, 64)
    assert all(np.isfinite(r["loss"]) for r in metrics_rows(trained))


def test_lora_in_kontext_pipeline_gives_the_trained_models_images(trained: Path) -> None:
    pipe = _pipeline()
    before = _sample(pipe, "make the circle red", EDIT / "before/circle.png", 64, 64)
    pipe.load_lora_weights(str(trained / "lora.safetensors"))  # type: ignore[attr-defined]
    after = _sample(pipe, "make the circle red", EDIT / "before/circle.png", 64, 64)
    with Image.open(trained / "samples/step-000004_00_make-the-circle-red.png") as img:
        ours = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert np.abs(after - ours).max() <= 1  # PNG rounding at most
    assert np.abs(before - ours).max() > 1


def test_kohya_layout_loads_in_kontext_pipeline(tmp_path: Path) -> None:
    kohya = train(tmp_path / "kohya", DOUBLE_BLOCKS, fmt="kohya")
    ref = train(tmp_path / "ref", DOUBLE_BLOCKS)
    assert all(k.startswith("lora_unet_") for k in load_file(str(kohya / "lora.safetensors")))
    images = []
    for out in (kohya, ref):
        pipe = _pipeline()
        pipe.load_lora_weights(str(out / "lora.safetensors"))  # type: ignore[attr-defined]
        images.append(_sample(pipe, "make the circle red", EDIT / "before/circle.png", 64, 64))
    assert np.abs(images[0] - images[1]).max() <= 1


def test_resume_with_controls_and_disk_caches_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = kontext_toml(tmp_path / "a", steps=6, extra=DISK)
    b = kontext_toml(tmp_path / "b", steps=6, extra=DISK)
    rows = stopped_and_resumed(a, b, monkeypatch, 3)
    assert rows[0] == rows[1] and len(rows[0]) == 6
    assert_same_lora(tmp_path / "a" / "out", tmp_path / "b" / "out")
    cache = [p for p in (tmp_path / "a").rglob("*.safetensors") if "latents" in p.parts]
    assert len(cache) == 8  # 4 target and 4 control latents on disk


def test_a_missing_or_unreadable_input_image_skips_only_its_prompt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prompts = tmp_path / "prompts" / "edit.txt"
    prompts.parent.mkdir()
    (prompts.parent / "broken.png").write_bytes(b"not an image")
    prompts.write_text(f"make the circle red --ci {(EDIT / 'before/circle.png').as_posix()} "
                       "--w 64 --h 64 --s 2\n"
                       "lost --ci nowhere.png --w 64 --h 64 --s 2\n"
                       "broken --ci broken.png --w 64 --h 64 --s 2\n", encoding="utf-8")
    with caplog.at_level("WARNING", logger="difftune"):
        out = train(tmp_path / "run", prompts=prompts, steps=2)
    names = sorted(p.name for p in (out / "samples").glob("step-000002_*.png"))
    assert names == ["step-000002_00_make-the-circle-red.png", "step-000002_grid.png"]
    text = caplog.text
    assert "nowhere.png does not exist" in text
    assert "sample prompt 'broken' skipped: an input image cannot be read" in text


def test_a_kontext_diffusers_folder_is_read_as_kontext(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """model.path alone: the folder's model_index.json (FluxKontextPipeline) picks the variant."""
    folder = tmp_path / "tiny-kontext"
    _pipeline().save_pretrained(str(folder), safe_serialization=True)  # type: ignore[attr-defined]
    cfg = kontext_toml(tmp_path, model=f'family = "flux"\npath = "{folder.as_posix()}"')
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "edit pairs: 4 complete" in out and "check passed" in out
