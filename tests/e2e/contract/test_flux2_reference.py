"""FLUX.2 reference images through the real CLI on the tiny flavors and the bundled edit pairs,
with two control folders per subset (before/ and a second folder made here): check reports the
pairs and the references' sizes, each pair gets its references in the folders' order, sampling
passes every --ci image to the pipeline, the LoRA loaded by Flux2KleinPipeline / Flux2Pipeline
gives the trained model's images, and a run with reference latents in disk caches resumes
exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from difftune import families
from difftune.cli import main
from difftune.config import ModelConfig, PrecisionConfig, load_config
from difftune.data.images import load_rgb
from difftune.precision.policy import PrecisionPolicy
from difftune.train.setup import load_data
from difftune.verbs.demo import demo_dir

from ..conftest import (
    assert_same_lora,
    metrics_rows,
    run_toml,
    stopped_and_resumed,
)

EDIT = demo_dir().parent / "edit"
MODELS = {"klein": 'flavor = "tiny"', "dev": 'flavor = "tiny"\nvariant = "dev"'}
SCALE = {"klein": "--l 4", "dev": "--g 2.5"}  # klein's real CFG, dev's distilled guidance
DISK = '\n[cache]\nlatents = "disk"\ntext = "disk"\n'


def second_folder(root: Path) -> Path:
    """A second reference folder beside the run: before/'s images inverted, same stems."""
    folder = root / "style"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for image in sorted((EDIT / "before").glob("*.png")):
            with Image.open(image) as img:
                ImageOps.invert(img.convert("RGB")).save(folder / image.name)
    return folder


def prompts_file(root: Path, variant: str) -> Path:
    """Two sample prompts, each naming both of its references (--ci twice)."""
    style = second_folder(root)
    path = root / "prompts.txt"
    path.write_text("".join(
        f"{text} --ci {(EDIT / 'before' / name).as_posix()} --ci {(style / name).as_posix()} "
        f"--w {w} --h {h} --s 4 {SCALE[variant]}\n"
        for text, name, w, h in (("make the circle red", "circle.png", 64, 64),
                                 ("turn the ring yellow", "ring.png", 96, 64))),
        encoding="utf-8")
    return path


def reference_toml(folder: Path, variant: str = "klein", **kw: object) -> Path:
    """`run_toml` on the bundled edit pairs with two control folders (before/, then style/)."""
    path = run_toml(folder, EDIT / "after", family="flux2", model=MODELS[variant],
                    **kw)  # type: ignore[arg-type]
    target = f'path = "{(EDIT / "after").as_posix()}"\n'
    text = path.read_text(encoding="utf-8")
    assert target in text
    folders = [(EDIT / "before").as_posix(), second_folder(folder.parent).as_posix()]
    path.write_text(text.replace(target, target + f"control_path = {json.dumps(folders)}\n"),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=["klein", "dev"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, Path]:
    """4 steps on the pairs with two references each, sampled with two --ci images a prompt."""
    root = tmp_path_factory.mktemp(f"ref-{request.param}")
    cfg = reference_toml(root / "run", request.param,
                         prompts=prompts_file(root, request.param))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    return request.param, root


def _pipeline(variant: str) -> object:
    family = families.get("flux2", variant)
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    return family.pipeline(family.load(ModelConfig(family="flux2", flavor="tiny",
                                                   variant=variant), policy))


def _sample(pipe: object, variant: str, root: Path) -> np.ndarray:
    """What the run's sampler renders for the first prompt line (seed 0, 4 steps)."""
    refs = [load_rgb(EDIT / "before/circle.png"), load_rgb(root / "style/circle.png")]
    inputs = families.get("flux2", variant).pipeline_images(refs, 64, 64)
    scale = 4.0 if variant == "klein" else 2.5
    out = pipe(prompt="make the circle red", width=64, height=64,  # type: ignore[operator]
               num_inference_steps=4, guidance_scale=scale,
               generator=torch.Generator("cpu").manual_seed(0), **inputs)
    return np.asarray(out.images[0], dtype=np.int16)


def test_check_reports_the_pairs_and_reference_sizes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = reference_toml(tmp_path / "run", prompts=prompts_file(tmp_path, "klein"))
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "edit pairs: 4 complete" in out and "sample works" in out
    # resolution 64: areas capped at 64 x 64 (96x64 -> 78x52), sides floored to 16
    assert "control size 64x64: 4" in out and "control size 64x48: 2" in out
    assert "control size 48x64: 2" in out


def test_each_pair_gets_its_references_in_the_folders_order(tmp_path: Path) -> None:
    cfg = load_config(reference_toml(tmp_path / "run"))
    items = load_data(cfg, families.get("flux2", "klein")).items
    assert len(items) == 4
    for item in items:
        assert [p.parent.name for p in item.controls] == ["before", "style"]
        assert all(p.stem == item.path.stem for p in item.controls)


def test_samples_use_both_references(trained: tuple[str, Path]) -> None:
    _, root = trained
    out = root / "run" / "out"
    names = sorted(p.name for p in (out / "samples").glob("step-000004_0*.png"))
    assert names == ["step-000004_00_make-the-circle-red.png",
                     "step-000004_01_turn-the-ring-yellow.png"]
    with Image.open(out / "samples" / names[1]) as img:
        assert img.size == (96, 64)
    assert all(np.isfinite(r["loss"]) for r in metrics_rows(out))


def test_sampling_passes_every_input_image_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline is called with both --ci images of a line, in the line's order (the tiny
    model's references move pixels too little to tell apart in a PNG)."""
    import diffusers

    seen: list[list[tuple[int, int]]] = []
    real = diffusers.Flux2KleinPipeline.__call__

    def spy(self: object, *args: object, **kwargs: object) -> object:
        seen.append([im.size for im in kwargs.get("image") or []])  # type: ignore[attr-defined]
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(diffusers.Flux2KleinPipeline, "__call__", spy)
    prompts = prompts_file(tmp_path, "klein")
    with Image.open(EDIT / "before/ring.png") as ring:
        ring.resize((80, 64)).save(tmp_path / "style" / "ring.png")  # told apart by size
    cfg = reference_toml(tmp_path / "run", prompts=prompts, steps=2)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    assert seen[:2] == [[(64, 64), (64, 64)], [(96, 64), (80, 64)]]  # step 0: 64x64, 96x64
    assert len(seen) == 4


def test_lora_in_the_pipeline_gives_the_trained_models_images(
        trained: tuple[str, Path]) -> None:
    variant, root = trained
    out = root / "run" / "out"
    pipe = _pipeline(variant)
    assert type(pipe).__name__ == families.spec("flux2", variant).pipeline_class
    before = _sample(pipe, variant, root)
    pipe.load_lora_weights(str(out / "lora.safetensors"))  # type: ignore[attr-defined]
    after = _sample(pipe, variant, root)
    with Image.open(out / "samples/step-000004_00_make-the-circle-red.png") as img:
        ours = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert np.abs(after - ours).max() <= 1  # PNG rounding at most
    assert np.abs(before - ours).max() > 1


def test_resume_with_references_and_disk_caches_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = reference_toml(tmp_path / "a", steps=6, extra=DISK)
    b = reference_toml(tmp_path / "b", steps=6, extra=DISK)
    rows = stopped_and_resumed(a, b, monkeypatch, 3)
    assert rows[0] == rows[1] and len(rows[0]) == 6
    assert_same_lora(tmp_path / "a" / "out", tmp_path / "b" / "out")
    cache = [p for p in (tmp_path / "a").rglob("*.safetensors") if "latents" in p.parts]
    assert len(cache) == 12  # 4 target and 8 reference latents on disk
