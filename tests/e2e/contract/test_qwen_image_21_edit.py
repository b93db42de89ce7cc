"""Qwen-Image 2.1's edit variant (the checkpoint's image-conditioned mode) through the real CLI
on the tiny flavor and the bundled edit pairs: training samples with each prompt's reference,
the LoRA loads in QwenImage21Pipeline (QwenImageLoraLoaderMixin; the pipeline encoding the
prompt with the reference itself) and gives the trained model's images; check reports the
pairs, and a run with reference latents and image-reading text entries in disk caches resumes
exactly."""

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

MODEL = 'family = "qwen_image_21"\nflavor = "tiny"\nvariant = "edit"'
END_ONLY = ("sample.at_start=false", "sample.every_n_steps=4")  # sample after step 4 only
SMALL = 64  # the samples' output_resolution in this module (the pipeline's is 1024)


@pytest.fixture(scope="module", autouse=True)
def small_references() -> Iterator[None]:
    """Samples size their reference at the pipeline's `output_resolution` (1024: a 1024 x 1024
    reference, most of a sampling round on a CPU); this module samples at 64, and the reload
    test gives the pipeline the same `output_resolution`."""
    from difftune.families.qwen_image_21 import edit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(edit, "OUTPUT_RESOLUTION", SMALL)
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, small_references: None) -> Path:
    """4 steps on the edit pairs, sampled once at the end with the bundled prompts (each
    with its reference by --ci)."""
    folder = tmp_path_factory.mktemp("q21edit")
    args = ["train", str(kontext_toml(folder, model=MODEL, prompts=EDIT / "prompts.txt")),
            "--no-progress"]
    for s in END_ONLY:
        args += ["--set", s]
    assert main(args) == 0
    return folder / "out"


def test_lora_in_the_pipeline_gives_the_edit_samples(trained: Path) -> None:
    """The samples exist at the prompts' sizes; the saved LoRA loaded by QwenImage21Pipeline
    (prompt and reference given as they are) gives the run's sample, and without it another."""
    names = sorted(p.name for p in (trained / "samples").glob("step-000004_0*.png"))
    assert names == ["step-000004_00_make-the-circle-red.png",
                     "step-000004_01_turn-the-ring-yellow.png"]
    assert all(np.isfinite(r["loss"]) for r in metrics_rows(trained))
    from diffusers import QwenImage21Pipeline

    family = families.get("qwen_image_21", "edit")
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    comps = family.load(ModelConfig(family="qwen_image_21", flavor="tiny", variant="edit"),
                        policy)
    pipe = QwenImage21Pipeline(transformer=comps.denoiser, vae=comps.vae,
                               scheduler=comps.scheduler, text_encoder=comps.text_encoders["qwen3vl"],
                               processor=comps.extras["processor"])
    pipe.set_progress_bar_config(disable=True)

    def sample() -> np.ndarray:
        out = pipe(prompt="make the circle red", image=load_rgb(EDIT / "before/circle.png"),
                   width=64, height=64, num_inference_steps=4, output_resolution=SMALL,
                   output_type="np", generator=torch.Generator("cpu").manual_seed(0))
        return np.round(out.images[0][..., :3] * 255).astype(np.int16)

    before = sample()
    pipe.load_lora_weights(str(trained / "lora.safetensors"))
    after = sample()
    with Image.open(trained / "samples/step-000004_00_make-the-circle-red.png") as img:
        ours = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert np.abs(after - ours).max() <= 1  # PNG rounding at most
    assert np.abs(before - ours).max() > 1


@pytest.mark.full_only  # the default run trains and samples the edit variant once, above
def test_check_reports_the_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = kontext_toml(tmp_path, model=MODEL, prompts=EDIT / "prompts.txt")
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "edit pairs: 4 complete" in out and "sample works" in out
    assert "control size 64x64: 4" in out


@pytest.mark.full_only
def test_resume_with_references_and_disk_caches_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = kontext_toml(tmp_path / "a", model=MODEL, steps=4, extra=DISK)
    b = kontext_toml(tmp_path / "b", model=MODEL, steps=4, extra=DISK)
    rows = stopped_and_resumed(a, b, monkeypatch, 2)
    assert rows[0] == rows[1] and len(rows[0]) == 4
    assert_same_lora(tmp_path / "a" / "out", tmp_path / "b" / "out")
    files = list((tmp_path / "a").rglob("*.safetensors"))
    assert len([p for p in files if "latents" in p.parts]) == 8  # 4 targets, 4 references
    assert len([p for p in files if "text" in p.parts]) == 4  # one per caption + reference
