"""Loss masks: found at discovery, prepared exactly like their image, reduced to the latent
grid by area, keyed by content, and the weighted-mean loss they give."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.cache import entry_key, latent_fields
from difftune.config import SubsetConfig
from difftune.config.data import DatasetConfig
from difftune.data import build
from difftune.data.images import crop_box, load_pixels
from difftune.data.masks import batch_weights, load_mask, to_latent_grid
from difftune.errors import DataError
from difftune.train import losses


def _shape(w: int, h: int) -> np.ndarray:
    """A white off-centre rectangle on black (no symmetry: a wrong flip or crop shows)."""
    arr = np.zeros((h, w), dtype=np.uint8)
    arr[h // 5: h // 2, w // 8: w // 2 + 3] = 255
    return arr


def _with_exif(img: Image.Image, path: Path) -> Path:
    exif = img.getexif()
    exif[0x0112] = 6  # stored sideways: upright, width and height swap
    img.save(path, exif=exif.tobytes())
    return path


@pytest.mark.parametrize("flip", [False, True])
def test_mask_file_is_aligned_with_its_image(tmp_path: Path, flip: bool) -> None:
    """Same EXIF rotation, resize to cover the bucket, random crop box and flip: the mask's
    white area is where the image's white area is (edges aside: the resamplers differ)."""
    shape = _shape(90, 52)
    image = _with_exif(Image.fromarray(shape).convert("RGB"), tmp_path / "a.png")
    mask = _with_exif(Image.fromarray(shape), tmp_path / "a_mask.png")
    size, bucket = (52, 90), (32, 48)  # upright size; a bucket of another aspect ratio
    box = crop_box(size, bucket, "random", random.Random(5))
    pixels = (load_pixels(image, bucket, box, flip)[0] + 1) / 2
    m = load_mask(image, mask, size, bucket, box, flip)
    assert m.shape == (48, 32) and 0.1 < m.mean() < 0.5
    assert ((pixels > 0.5) != (m > 0.5)).float().mean() < 0.02


def test_alpha_channel_is_the_mask(tmp_path: Path) -> None:
    rgba = Image.new("RGBA", (32, 32), (200, 10, 10, 0))
    rgba.paste((200, 10, 10, 255), (0, 0, 16, 32))
    rgba.save(tmp_path / "a.png")
    m = load_mask(tmp_path / "a.png", None, (32, 32), (32, 32), (0, 0, 32, 32), False)
    assert torch.equal(m[:, :16], torch.ones(32, 16)) and not m[:, 16:].any()
    Image.new("RGB", (32, 32)).save(tmp_path / "b.png")  # no alpha: fully trained
    assert load_mask(tmp_path / "b.png", None, (32, 32), (32, 32), (0, 0, 32, 32),
                     False).min() == 1


def test_area_reduction_to_the_latent_grid() -> None:
    mask = torch.zeros(16, 32)
    mask[:4, :4] = 1  # a quarter of the first 8x8 cell
    grid = to_latent_grid(mask, (2, 4))
    expected = torch.zeros(2, 4)
    expected[0, 0] = 0.25
    assert torch.equal(grid, expected)
    with pytest.raises(ValueError, match="does not divide"):
        to_latent_grid(mask, (3, 4))


def test_batch_weights_apply_the_floor_and_fill_unmasked_samples() -> None:
    masked = {"latent": torch.zeros(4, 2, 2), "mask": torch.tensor([[1.0, 0.0], [0.5, 0.0]])}
    plain = {"latent": torch.zeros(4, 2, 2)}
    w = batch_weights([masked, plain], [0.2, 0.2])
    assert torch.allclose(w[0], torch.tensor([[1.0, 0.2], [0.6, 0.2]]))
    assert torch.equal(w[1], torch.ones(2, 2))


def test_mask_content_is_part_of_the_latent_key(tmp_path: Path) -> None:
    img, mask = tmp_path / "a.png", tmp_path / "m.png"
    img.write_bytes(b"image")
    mask.write_bytes(b"mask one")
    args = dict(family="flux", fingerprint="m1", dtype="float32", image=img, bucket=(64, 64),
                box=(0, 0, 64, 64), flip=False)
    plain = entry_key(latent_fields(**args))  # type: ignore[arg-type]
    masked = entry_key(latent_fields(**args, mask=mask))  # type: ignore[arg-type]
    alpha = entry_key(latent_fields(**args, alpha_mask=True))  # type: ignore[arg-type]
    assert len({plain, masked, alpha}) == 3
    mask.write_bytes(b"mask two")
    assert entry_key(latent_fields(**args, mask=mask)) != masked  # type: ignore[arg-type]
    assert entry_key(latent_fields(**args)) == plain  # type: ignore[arg-type]


def test_masked_loss_is_the_weighted_mean() -> None:
    g = torch.Generator().manual_seed(0)
    err = torch.rand(2, 3, 4, 4, generator=g)
    mask = torch.rand(2, 4, 4, generator=g)
    per = losses.per_sample(err, mask)
    for b in range(2):
        w = mask[b].expand(3, 4, 4)
        assert torch.allclose(per[b], (err[b] * w).sum() / w.sum())
    assert torch.equal(losses.per_sample(err), err.flatten(1).mean(dim=1))  # no mask: as before
    frames = err[:, :, None]  # (B, C, 1, h, w) layouts broadcast on the last two axes
    assert torch.allclose(losses.per_sample(frames, mask), per)
    assert losses.per_sample(err, torch.zeros(2, 4, 4)).eq(0).all()  # nothing masked in: 0
    with pytest.raises(ValueError, match="latent grid"):  # e.g. packed tokens: refused
        losses.per_sample(err.flatten(2), mask)


def _folder(root: Path, masks: dict[str, Image.Image | bytes]) -> SubsetConfig:
    (root / "img").mkdir(parents=True)
    (root / "masks").mkdir()
    for name in ("a", "b", "c"):
        Image.new("RGB", (32, 32)).save(root / "img" / f"{name}.png")
    for name, content in masks.items():
        if isinstance(content, bytes):
            (root / "masks" / name).write_bytes(content)
        else:
            content.save(root / "masks" / name)
    return SubsetConfig(path=root / "img", mask_path=root / "masks", unmasked_weight=0.3)


def test_discovery_matches_masks_and_names_every_missing_one(tmp_path: Path) -> None:
    gray = Image.new("L", (32, 32), 255)
    sub = _folder(tmp_path / "ok", {"a.png": gray, "b.jpg": gray.convert("RGB"), "c.webp": gray})
    items = build([DatasetConfig(resolution=64, min_side=32, subsets=[sub])], 16).items
    assert [it.mask.name for it in items] == ["a.png", "b.jpg", "c.webp"]  # type: ignore[union-attr]
    assert all(it.masked and it.unmasked_weight == 0.3 for it in items)
    sub = _folder(tmp_path / "bad", {"a.png": gray, "c.png": b"not an image"})
    with pytest.raises(DataError) as err:
        build([DatasetConfig(resolution=64, min_side=32, subsets=[sub])], 16)
    text = str(err.value)
    assert "2 image(s) have no usable mask" in text and "b.png: no mask b.*" in text
    assert "c.png is unreadable" in text


def test_mask_config_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="either mask_path"):
        SubsetConfig(path=tmp_path, mask_path=tmp_path, alpha_mask=True)
    with pytest.raises(ValueError):
        SubsetConfig(path=tmp_path, alpha_mask=True, unmasked_weight=1.5)
    sub = SubsetConfig(path=tmp_path, mask_path=tmp_path / "masks")
    (tmp_path / "masks").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    with pytest.raises(DataError, match="lies inside the image folder"):
        build([DatasetConfig(resolution=64, min_side=32, subsets=[sub])], 16)


def test_unmasked_weight_without_masks_is_reported_as_ignored(tmp_path: Path) -> None:
    assert "unmasked_weight (needs mask_path or alpha_mask)" in SubsetConfig(
        path=tmp_path, unmasked_weight=0.5).ignored_caption_options()
    assert not SubsetConfig(path=tmp_path, alpha_mask=True,
                            unmasked_weight=0.5).ignored_caption_options()
