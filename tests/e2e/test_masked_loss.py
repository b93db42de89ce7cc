"""Masked loss end to end on tiny FLUX.1: the background gets no gradient, a masked run trains,
resumes exactly and round-trips its masks through the disk cache, `check` reports the masks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune import families
from difftune.cli import main
from difftune.config import load_config
from difftune.train.setup import fill_caches, prepare
from difftune.train.step import batch_loss

from .conftest import family_tier, run_toml, stopped_and_resumed


def masked_folder(root: Path) -> tuple[Path, Path]:
    """Four 64x64 captioned images (a coloured left half on a varied background) in
    root/images, and their masks in root/masks: the left half white, the right half black."""
    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True), masks.mkdir()
    for n in range(4):
        img = Image.new("RGB", (64, 64), (40 * n, 200 - 30 * n, 90))
        img.paste((220, 30 + 40 * n, 40), (0, 0, 32, 64))
        img.save(images / f"im{n}.png")
        (images / f"im{n}.txt").write_text(f"a red half number {n}", encoding="utf-8")
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (0, 0, 32, 64))
        mask.save(masks / f"im{n}.png")
    return images, masks


def masked_toml(folder: Path, images: Path, masks: Path, floor: float = 0.0, **kw: object
                ) -> Path:
    """A tiny FLUX.1 run file whose one subset is masked by `masks`."""
    path = run_toml(folder, images, **kw)  # type: ignore[arg-type]
    text = path.read_text().replace(
        "resolution = 64",
        f'mask_path = "{masks.as_posix()}"\nunmasked_weight = {floor}\nresolution = 64', 1)
    path.write_text(text, encoding="utf-8")
    return path


def prepared_keeping_predictions(cfg: Path, monkeypatch: pytest.MonkeyPatch
                                 ) -> tuple[Any, list[torch.Tensor]]:
    """The prepared run of `cfg` (caches filled) and the list its family's predictions are kept
    in from now on, each retaining its gradient, to see where a masked loss reaches."""
    run = prepare(load_config(cfg), show_progress=False)
    fill_caches(run, [], show_progress=False)
    seen: list[torch.Tensor] = []
    predict = run.family.predict

    def keeping(*args: object) -> torch.Tensor:
        out = predict(*args)  # type: ignore[arg-type]
        out.retain_grad()
        seen.append(out)
        return out

    monkeypatch.setattr(run.family, "predict", keeping)
    return run, seen


def latent_grid(name: str) -> tuple[str, int]:
    """What decides the latent grid the mask is reduced to, from the family's spec: its
    denoiser (a UNet's plain latents, a transformer's packed tokens) and its bucket step (the
    VAE's downscale times the patch: 16 for the /8 VAEs, 32 for Qwen-Image 2.1's /16 one)."""
    spec = families.spec(name)
    return spec.denoiser_part, spec.bucket_step


# By default one family per latent grid (`conftest.family_tier` of `latent_grid`): today
# FLUX.1 (2x2-packed tokens on a /8 grid), SDXL (plain latents) and Qwen-Image 2.1 (packed
# frames on a /16 grid); the rest with --full.
@pytest.mark.parametrize("family", family_tier(latent_grid))
def test_background_gets_no_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     family: str) -> None:
    """With unmasked_weight 0 the loss does not depend on the prediction outside the mask (its
    gradient there is exactly 0, so changing the target's background changes nothing), and
    does inside: a run that ignored masks would fail both checks. Every family's prediction
    comes back on the latent grid the mask is reduced to."""
    images, masks = masked_folder(tmp_path / "data")
    cfg = masked_toml(tmp_path, images, masks, family=family)
    run, seen = prepared_keeping_predictions(cfg, monkeypatch)
    loss = batch_loss(run, [0, 1], [False, False], torch.Generator().manual_seed(0))
    loss.backward()
    grad = seen[0].grad
    assert grad is not None
    side = grad.shape[-1]  # 64 px / the VAE's 8 (16 for Qwen-Image 2.1's)
    assert grad.shape[-2:] == (side, side) and side in (8, 4)
    assert torch.all(grad[..., side // 2:] == 0)  # the right half of the grid: background
    assert torch.all(grad[..., :side // 2].abs().sum(dim=(1, 2)) > 0)


def test_masked_run_resumes_exactly_from_the_disk_cache(tmp_path: Path, monkeypatch:
                                                        pytest.MonkeyPatch) -> None:
    """Uninterrupted with masks computed live (cache.latents = "none") equals stopped and
    resumed with masks read back from the disk cache; the entries hold the masks."""
    images, masks = masked_folder(tmp_path / "data")
    live = masked_toml(tmp_path / "a", images, masks, 0.1, steps=4,
                       extra='[cache]\nlatents = "none"\n')
    disk = masked_toml(tmp_path / "b", images, masks, 0.1, steps=4,
                       extra='[cache]\nlatents = "disk"\n')
    a, b = stopped_and_resumed(live, disk, monkeypatch, 2)
    assert a == b and [s for s, _ in a] == [1, 2, 3, 4]
    entries = [load_file(str(p)) for p in (tmp_path / "b/out/cache").rglob("*.safetensors")]
    stored = [e["mask"] for e in entries if "mask" in e]
    assert len(stored) == 4 and all(m.shape == (8, 8) for m in stored)
    assert all(torch.equal(m[:, :4], torch.ones(8, 4)) and not m[:, 4:].any() for m in stored)


def test_check_reports_masks_and_missing_ones(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    images, masks = masked_folder(tmp_path / "data")
    cfg = masked_toml(tmp_path, images, masks)
    assert main(["check", str(cfg)]) == 0
    assert ("masked loss: datasets[0].subsets[0]: 4 images masked by mask files, mean masked "
            "area 50%, unmasked_weight 0") in capsys.readouterr().out
    (masks / "im2.png").unlink()
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "datasets[0].subsets[0].mask_path: 1 image(s) have no usable mask" in err
    assert "im2.png: no mask im2.* in" in err
