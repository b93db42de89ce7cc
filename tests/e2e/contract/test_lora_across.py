"""LoRAs read across families (`FamilySpec.lora_sources`, adapters/across.py) through the real
CLI: the contract run's FLUX.1 LoRA sampled on Chroma, whose spec declares it reads FLUX.1's.

The run's LoRA trains every linear layer of the blocks (`all_linear`), so it holds FLUX.1's
modulation layers, which Chroma lacks; a guidance-embedder module is added to it (what a LoRA
trained on more than the blocks holds). Both are named in a warning, and the image is the one
Chroma gives with the file's other modules merged into its weights by hand."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters.formats import group_modules
from difftune.cli import main

from ..conftest import run_toml, tiny_pipeline


def _pixels(folder: Path) -> np.ndarray:
    """The one sample `difftune sample` wrote into `folder`, as integers."""
    return np.asarray(Image.open(next(folder.glob("*_00_*.png"))).convert("RGB")).astype(int)


def _chroma_folders(flux_lora: Path, root: Path) -> tuple[Path, Path]:
    """The tiny Chroma saved as a diffusers folder, as it is and with each module of the
    FLUX.1 file that Chroma has merged into its weight by hand (W + B @ A: the file's alpha is
    its rank, 4). Both are folders so that they sample alike (a folder's T5 reads 512 tokens,
    the tiny flavor's 32)."""
    pipe = tiny_pipeline("chroma")
    pipe.save_pretrained(str(root / "base"), safe_serialization=True)
    named = dict(pipe.transformer.named_modules())
    merged = 0
    with torch.no_grad():
        for module, pair in group_modules(load_file(str(flux_lora)), 4.0).items():
            layer = named.get(module.removeprefix("transformer."))
            if layer is not None:
                layer.weight += pair.delta()
                merged += 1
    assert merged >= 20  # attention and MLP projections of every block
    pipe.save_pretrained(str(root / "merged"), safe_serialization=True)
    return root / "base", root / "merged"


def _with_guidance_embedder(lora: Path, out: Path) -> Path:
    """`lora` (its metadata kept) with a LoRA on FLUX.1's guidance embedder added."""
    tensors = load_file(str(lora))
    with safe_open(str(lora), "pt") as f:
        meta = f.metadata()
    module = "transformer.time_text_embed.guidance_embedder.linear_1"
    tensors[f"{module}.lora_A.weight"] = torch.ones(4, 256)  # the tiny FLUX.1's 256 channels
    tensors[f"{module}.lora_B.weight"] = torch.ones(256, 4)
    save_file(tensors, str(out), metadata=meta)
    return out


def test_a_flux_lora_samples_on_chroma_as_merged_by_hand(
        trained: Callable[[str], Path], images: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    flux = _with_guidance_embedder(trained("flux") / "lora.safetensors", tmp_path / "f.safetensors")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 16 --h 16 --s 1 --d 1\n", encoding="utf-8")
    base, merged = _chroma_folders(flux, tmp_path)
    cfg, by_hand = (run_toml(tmp_path / f"{d.name}_run", images, family="chroma",
                             prompts=prompts, model=f'path = "{d.as_posix()}"')
                    for d in (base, merged))
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert main(["sample", str(cfg), "--lora", str(flux), "--out", str(tmp_path / "a")]) == 0
    assert ("1 flux module(s) not applied (FLUX.1's timestep, guidance and pooled-text "
            "embedders: Chroma feeds those inputs to its distilled guidance network and has no "
            "such layers): transformer.time_text_embed.guidance_embedder.linear_1") in caplog.text
    assert ("6 flux module(s) not applied (FLUX.1's modulation layers: Chroma's are pruned (its "
            "distilled guidance network makes the modulation)): "
            "transformer.single_transformer_blocks.N.norm.linear (x2), "
            "transformer.transformer_blocks.N.norm1.linear (x2), "
            "transformer.transformer_blocks.N.norm1_context.linear (x2)") in caplog.text
    assert main(["sample", str(cfg), "--out", str(tmp_path / "b")]) == 0
    assert main(["sample", str(by_hand), "--out", str(tmp_path / "c")]) == 0
    lora, plain, hand = (_pixels(tmp_path / d) for d in "abc")
    assert np.abs(lora - plain).max() >= 4  # the LoRA's effect is there
    assert np.abs(lora - hand).max() <= 1  # and it is the file's weights (PNG rounding aside)


def test_a_lora_of_a_family_not_declared_is_refused(
        trained: Callable[[str], Path], images: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Chroma's LoRA on FLUX.1 (FLUX.1 declares no source): exit 2 naming both families,
    before the model loads; with a module of another shape, on Chroma: exit 2 naming it."""
    chroma = trained("chroma") / "lora.safetensors"
    cfg = run_toml(tmp_path, images, family="flux")
    assert main(["sample", str(cfg), "--lora", str(chroma)]) == 2
    err = capsys.readouterr().err
    assert (f"{chroma} is a chroma LoRA (its difftune.family metadata), but this run's "
            "model.family is \"flux\", which does not read chroma LoRAs") in err
    assert "Traceback" not in err
    flux = trained("flux") / "lora.safetensors"
    tensors = load_file(str(flux))
    with safe_open(str(flux), "pt") as f:
        meta = f.metadata()
    module = "transformer.transformer_blocks.0.attn.to_q"
    tensors[f"{module}.lora_A.weight"] = torch.zeros(4, 128)  # a model of half the width
    save_file(tensors, str(tmp_path / "narrow.safetensors"), metadata=meta)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 16 --h 16 --s 1\n", encoding="utf-8")
    cfg = run_toml(tmp_path / "chroma", images, family="chroma", prompts=prompts)
    assert main(["sample", str(cfg), "--lora", str(tmp_path / "narrow.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{module}.lora_A.weight has shape (4, 128)" in err and "Traceback" not in err


def test_init_lora_starts_a_chroma_run_from_a_kohya_flux_lora(
        trained: Callable[[str], Path], images: Path, tmp_path: Path) -> None:
    """`--init-lora` with the FLUX.1 LoRA in kohya's layout and no metadata (as other trainers
    write it; Chroma's own reader has no name for FLUX.1's modulation layers, FLUX.1's reads
    it): the file's modules that Chroma has start the Chroma run's LoRA with the same update
    (up factors rescaled from the file's alpha = rank to the run's alpha 8 / rank 4)."""
    from difftune.families.flux.keys import diffusers_to_kohya
    from difftune.train.init_lora import load_init_lora

    from ..test_init_lora import manager

    file = load_file(str(trained("flux") / "lora.safetensors"))
    kohya = tmp_path / "flux_kohya.safetensors"
    save_file(diffusers_to_kohya(file, alpha=4.0, rank=4), str(kohya))  # no metadata
    m = manager(run_toml(tmp_path, images, family="chroma"))
    load_init_lora(kohya, m)
    got = {k: p.detach() for k, p in m.trainable().items()}
    read = [k for k in got if k in file]
    assert len(read) >= 40 and len(read) == sum(1 for k in file if ".norm" not in k)
    for key in read:
        factor = 0.5 if "lora_B" in key else 1.0
        assert torch.equal(got[key], file[key] * factor), key


def test_lora_merge_of_a_flux_lora_into_a_chroma_file(
        trained: Callable[[str], Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`lora merge` into Chroma's denoiser file with `--family chroma`: the modules Chroma
    lacks are listed as not merged with the declaration's reason, the others merged; with the
    file read as FLUX.1's (`--family flux`, what the file's names alone tell) a module the base
    lacks is refused, naming it (formerly it was left out unsaid)."""
    from difftune.families.chroma.tiny import build_tiny_chroma

    flux = str(trained("flux") / "lora.safetensors")
    base = tmp_path / "chroma.safetensors"
    weights = {k: v.contiguous() for k, v in build_tiny_chroma()["transformer"]
               .state_dict().items()}
    save_file(weights, str(base))
    out = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", str(base), "--lora", flux, "--family", "chroma",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("not merged: lora.safetensors: transformer.transformer_blocks.0.norm1.linear "
            "(FLUX.1's modulation layers: Chroma's are pruned") in text
    pair = group_modules(load_file(flux), 4.0)["transformer.transformer_blocks.0.attn.to_q"]
    key = "transformer_blocks.0.attn.to_q.weight"
    torch.testing.assert_close(load_file(str(out))[key], weights[key] + pair.delta())
    assert main(["lora", "merge", str(base), "--lora", flux, "--family", "flux", "--out",
                 str(tmp_path / "m2.safetensors")]) == 2
    assert "norm.linear has no tensor in the base file" in capsys.readouterr().err
