"""The contract every family passes through the real CLI, on its tiny flavor.

A sampled 4-step run writes its outputs, metrics, samples and LoRA metadata; diffusers' own
loader reads the LoRA with no leftover key and it changes the images; `check` passes on the
tiny flavor and on the model saved as a diffusers folder. Parametrized over the registry.

Tiers: everything runs for every family by default but `check` on the tiny flavor with the
family's sample prompts, which repeats for each family what the diffusers-folder check (every
family: its own loader, the check's training step) and the reference run's samples (every
family) already show: by default it runs for the first family only (`family_tier`), every
family with `pytest --full`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from difftune import families
from difftune.cli import main

from ..conftest import family_tier, metrics_rows, pipeline_image, run_toml, tiny_pipeline
from .conftest import sample_prompts

Trained = Callable[[str], Path]


@pytest.mark.parametrize("family", families.names())
def test_outputs(family: str, trained: Trained) -> None:
    out = trained(family)
    names = {p.name for p in out.iterdir()}
    assert {"lora.safetensors", "lora-step000002.safetensors", "metrics.jsonl",
            "config.resolved.json", "difftune.log", "samples", "tensorboard"} <= names
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and 0 < r["loss"] < 100 for r in rows)
    assert all("lr" in r and "it_per_s" in r for r in rows)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    samples = sorted(p.name for p in (out / "samples").glob("step-*_0*.png"))
    # at_start (0), every 2 steps (2), and at the end (4); each prompt, named by prompt.
    slugs = sample_prompts(family)[1]
    assert samples == [f"step-{s:06d}_{i:02d}_{slug}.png" for s in (0, 2, 4)
                       for i, slug in enumerate(slugs)]
    resolved = json.loads((out / "config.resolved.json").read_text())
    assert resolved["train"]["steps"] == 4 and resolved["adapter"]["rank"] == 4


@pytest.mark.parametrize("family", families.names())
def test_metadata(family: str, trained: Trained) -> None:
    with safe_open(str(trained(family) / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["difftune.family"] == family
    assert meta["difftune.base_model"] == f"difftune/tiny-{family}"
    # diffusers layout: the scale (8/4) is folded into the up factors, so the file's alpha is 4
    assert meta["difftune.rank"] == "4" and meta["difftune.alpha"] == "4.0"
    assert meta["difftune.trained_alpha"] == "8.0"
    assert meta["difftune.steps"] == "4"
    assert json.loads(meta["difftune.dataset"])["images"] == 6
    assert json.loads(meta["difftune.targets"])
    assert meta["difftune.version"]


@pytest.mark.parametrize("family", families.names())
def test_lora_loads_in_diffusers_and_changes_output(family: str, trained: Trained) -> None:
    size = max(32, families.get(family).bucket_step)
    pipe = tiny_pipeline(family)
    before = pipeline_image(pipe, size=size)
    pipe.load_lora_weights(str(trained(family) / "lora.safetensors"))
    assert not torch.allclose(before, pipeline_image(pipe, size=size), atol=1e-4)
    # No leftover key: every tensor of the file became a LoRA weight of the model, unchanged.
    prefix = families.get(family).denoiser_prefix
    file = load_file(str(trained(family) / "lora.safetensors"))
    loaded = get_peft_model_state_dict(getattr(pipe, prefix), adapter_name="default_0")
    assert {f"{prefix}.{k}" for k in loaded} == set(file)
    for key, value in loaded.items():
        assert torch.equal(value, file[f"{prefix}.{key}"])


@pytest.mark.parametrize("family", family_tier(lambda name: "check on the tiny flavor"))
def test_check_passes(family: str, tmp_path: Path, images: Path,
                      family_prompts: Callable[[str], Path],
                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family=family, prompts=family_prompts(family))
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    for part in (f"model: difftune/tiny-{family}", "training step: loss", "check passed"):
        assert part in out


@pytest.mark.parametrize("family", families.names())
def test_check_on_a_diffusers_folder(family: str, tmp_path: Path, images: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """model.path: the tiny model saved in its family's diffusers layout."""
    folder = tmp_path / f"tiny-{family}"
    tiny_pipeline(family).save_pretrained(str(folder), safe_serialization=True)
    cfg = run_toml(tmp_path, images, family=family, model=f'path = "{folder.as_posix()}"')
    assert main(["check", str(cfg)]) == 0
    out = capsys.readouterr().out
    for part in (f"model: tiny-{family}", "training step: loss", "check passed"):
        assert part in out
