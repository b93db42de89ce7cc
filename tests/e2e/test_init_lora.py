"""`--init-lora`: a new run starts from a LoRA file in any layout difftune writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main
from difftune.config import load_config
from difftune.errors import CheckpointError
from difftune.train.checkpoint import CheckpointManager
from difftune.train.init_lora import load_init_lora
from difftune.train.setup import prepare

from .conftest import run_toml


def manager(cfg_path: Path, *sets: str) -> CheckpointManager:
    cfg = load_config(cfg_path, list(sets))
    run = prepare(cfg, show_progress=False)
    return CheckpointManager(cfg, run.family, run.comps, run.targets, {})


def trained(out: Path) -> dict[str, torch.Tensor]:
    """The canonical trained weights of a finished run (its last checkpoint)."""
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    return load_file(str(last / "trainable.safetensors"))


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    folder = tmp_path_factory.mktemp("init_flux")
    cfg = run_toml(folder, images, steps=3)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    return folder


def test_diffusers_file_with_another_alpha(flux_run: Path, tmp_path: Path, images: Path) -> None:
    src = trained(flux_run / "out")
    m = manager(run_toml(tmp_path, images), "adapter.alpha=2")  # the file: rank 4, alpha 8
    load_init_lora(flux_run / "out" / "lora.safetensors", m)
    got = {k: p.detach() for k, p in m.trainable().items()}
    assert got.keys() == src.keys()
    for key, value in src.items():
        factor = 4.0 if "lora_B" in key else 1.0  # (8/4) / (2/4): the same delta W
        assert torch.equal(got[key], value * factor), key


def test_kohya_file_with_text_encoders(tmp_path: Path, images: Path) -> None:
    src_dir = tmp_path / "src"
    cfg = run_toml(src_dir, images, fmt="kohya", family="sdxl")
    assert main(["train", str(cfg), "--no-progress", "--set", "train.steps=2", "--set",
                 'adapter.text_encoders=["clip_l","clip_g"]']) == 0
    src = trained(src_dir / "out")
    m = manager(run_toml(tmp_path / "new", images, family="sdxl"),
                'adapter.text_encoders=["clip_l","clip_g"]')
    load_init_lora(src_dir / "out" / "lora.safetensors", m)
    got = m.trainable()
    assert {k.split(".")[0] for k in src} == {"unet", "text_encoder", "text_encoder_2"}
    for key, value in src.items():
        torch.testing.assert_close(got[key].detach(), value, rtol=0, atol=1e-7)


def test_init_lora_through_the_cli(flux_run: Path, tmp_path: Path, images: Path) -> None:
    fresh, init = tmp_path / "fresh", tmp_path / "init"
    fresh.mkdir()
    init.mkdir()
    assert main(["train", str(run_toml(fresh, images, steps=1)), "--no-progress"]) == 0
    assert main(["train", str(run_toml(init, images, steps=1)), "--no-progress", "--init-lora",
                 str(flux_run / "out" / "lora.safetensors")]) == 0
    loss = [json.loads((d / "out" / "metrics.jsonl").read_text())["loss"] for d in (fresh, init)]
    assert loss[0] != loss[1]  # the first step already ran with the file's weights


def test_modules_the_run_does_not_train_are_refused(flux_run: Path, tmp_path: Path,
                                                    images: Path) -> None:
    m = manager(run_toml(tmp_path, images), 'adapter.targets="attention"')
    with pytest.raises(CheckpointError, match="modules this run does not train"):
        load_init_lora(flux_run / "out" / "lora.safetensors", m)
    m = manager(run_toml(tmp_path, images), "adapter.rank=8")
    with pytest.raises(CheckpointError, match="set adapter.rank"):
        load_init_lora(flux_run / "out" / "lora.safetensors", m)


def test_a_lora_of_another_family_is_refused_naming_both(flux_run: Path, tmp_path: Path,
                                                         images: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """A FLUX.1 LoRA difftune wrote, given to an SD 1.5 run: `sample --lora` and
    `train --init-lora` exit 2 naming the file's family and the run's (not peft's unmatched
    target modules, nor "modules this run does not train")."""
    lora = str(flux_run / "out" / "lora.safetensors")
    cfg = str(run_toml(tmp_path, images, family="sd15", steps=1))
    assert main(["sample", cfg, "--lora", lora]) == 2
    assert f'{lora} is a flux LoRA (its difftune.family metadata), but this run\'s ' \
        'model.family is "sd15"' in capsys.readouterr().err
    assert main(["train", cfg, "--no-progress", "--init-lora", lora]) == 2
    assert "is a flux LoRA" in capsys.readouterr().err
    a14b = str(run_toml(tmp_path / "a14b", images, family="wan", steps=1,
                        model='flavor = "tiny"\nvariant = "2.2-t2v-a14b"'))  # two experts
    assert main(["train", a14b, "--no-progress", "--init-lora", lora]) == 2
    assert 'model.family is "wan"' in capsys.readouterr().err
