"""Loss masks: finding each image's mask, and preparing it exactly as its image is prepared.

A subset with `mask_path` matches every image to the mask of the same path relative to the
subset folder, extension aside (as edit pairs match control images); with `alpha_mask` the
image's own alpha channel is its mask (an image without one is fully trained). A missing,
ambiguous or unreadable mask is a `DataError` at discovery, naming the files, never a surprise
mid-run. A mask goes through the image's EXIF orientation, resize to cover the bucket, crop
box and flip, and is then reduced to the latent grid by area averaging, so each latent
position is weighted by the share of its pixels that are masked in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from difftune.config import SubsetConfig
from difftune.data.buckets import Bucket, cover_size
from difftune.data.images import _to_8_bits, probe_image, strict_decoding
from difftune.data.pairs import _partner
from difftune.errors import DataError

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def check_mask_folder(sub: SubsetConfig, where: str) -> None:
    """Refuse a mask folder that is missing, not a folder, or inside the searched image folder
    (its masks would be trained on as images). `where` names the subset in messages."""
    folder, field = sub.mask_path, f"{where}.mask_path"
    if folder is None:
        return
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise DataError(f"{field}: {folder} {what}; point it at the folder of masks")
    if sub.recursive and folder.resolve().is_relative_to(sub.path.resolve()):
        raise DataError(f"{field}: {folder} lies inside the image folder {sub.path}, which is "
                        "searched recursively, so its masks would be trained on as images; move "
                        f"it beside the image folder or set {where}.recursive = false")


def find_masks(images: list[Path], sub: SubsetConfig, where: str) -> list[Path | None]:
    """The mask file of each image (None for all with `alpha_mask` or no masks). Every image of
    a `mask_path` subset needs a readable mask: the problems are gathered and raised together."""
    if sub.mask_path is None:
        return [None] * len(images)
    found: list[Path | None] = []
    problems = []
    for image in images:
        mask = _partner(image, sub.path, sub.mask_path, what="mask")
        if isinstance(mask, Path):
            try:
                probe_image(mask)
            except (ValueError, OSError) as err:
                mask = f"its mask {mask} is unreadable: {err}"
        if isinstance(mask, str):
            problems.append(f"{image.name}: {mask}")
        found.append(mask if isinstance(mask, Path) else None)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise DataError(f"{where}.mask_path: {len(problems)} image(s) have no usable mask: "
                        f"{'; '.join(problems[:5])}{more}. Every image of a masked subset needs "
                        "a grayscale mask of the same name (white = trained); add it, or move "
                        "the image to a subset without mask_path")
    return found


def _decoded(path: Path) -> Image.Image:
    """`path` decoded strictly, EXIF orientation applied, 16-bit gray scaled to 8 bits."""
    with strict_decoding(), Image.open(path) as raw:
        return _to_8_bits(ImageOps.exif_transpose(raw))


def mask_image(image: Path, mask: Path | None, size: tuple[int, int]) -> Image.Image:
    """The "L" mask of `image` at its upright `size`: the mask file's gray values (stretched to
    the image's size if it has another), or the image's alpha channel (when `mask` is None;
    fully white for an image without alpha)."""
    if mask is not None:
        img = _decoded(mask).convert("L")
    else:
        decoded = _decoded(image)
        has_alpha = decoded.mode in _ALPHA_MODES or "transparency" in decoded.info
        if not has_alpha:
            return Image.new("L", size, 255)
        img = decoded.convert("RGBA").getchannel("A")
    if img.size != tuple(size):
        img = img.resize(size, Image.Resampling.BILINEAR)
    return img


def load_mask(image: Path, mask: Path | None, size: tuple[int, int], bucket: Bucket,
              box: tuple[int, int, int, int], flip: bool) -> torch.Tensor:
    """The (H, W) float32 mask in [0, 1] of a sample, aligned pixel for pixel with
    `load_pixels(image, bucket, box, flip)`: resized to cover the bucket, cropped, mirrored."""
    return fit_mask(mask_image(image, mask, size), bucket, box, flip)


def fit_mask(img: Image.Image, bucket: Bucket, box: tuple[int, int, int, int], flip: bool
         ) -> torch.Tensor:
    """An "L" mask resized to cover `bucket`, cropped to `box`, mirrored with `flip`, as an
    (H, W) float32 tensor in [0, 1] (the steps `load_pixels` applies to the image)."""
    target = cover_size(img.size, bucket)
    if img.size != target:
        img = img.resize(target, Image.Resampling.BILINEAR)
    img = img.crop(box)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).float() / 255.0


def to_latent_grid(mask: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """An (H, W) pixel mask reduced to the (h, w) latent grid by area averaging: each latent
    position gets the mean of the pixels it covers (H / h of them a side, the VAE's factor)."""
    h, w = grid
    if mask.shape[0] % h or mask.shape[1] % w:
        raise ValueError(f"a {tuple(mask.shape)} mask does not divide into a {grid} latent grid")
    return F.adaptive_avg_pool2d(mask[None, None], (h, w))[0, 0]


def weights(mask: torch.Tensor, unmasked_weight: float) -> torch.Tensor:
    """Loss weights from a mask in [0, 1]: `unmasked_weight` where it is black, 1 where white."""
    return unmasked_weight + (1.0 - unmasked_weight) * mask


def mean_area(image: Path, mask: Path | None, size: tuple[int, int]) -> float:
    """The share of an image that its mask trains (the mean of the mask, 0..1), for reports."""
    img = mask_image(image, mask, size)
    return float(np.asarray(img, dtype=np.float32).mean() / 255.0)


def batch_weights(entries: list[dict[str, torch.Tensor]], floors: list[float]
                  ) -> torch.Tensor:
    """(B, h, w) loss weights of a batch from its latent entries (`LatentSource.sample`): each
    masked entry's mask with its subset's `unmasked_weight` (`floors`), 1 for an unmasked one.
    A batch of clips carries (B, f, h, w) weights (one bucket: every clip has the same grid)."""
    grid = next((tuple(e["mask"].shape) for e in entries if "mask" in e), None)
    out = []
    for entry, floor in zip(entries, floors, strict=True):
        mask = entry.get("mask")
        if mask is None:  # a masked sibling's grid ((f, h, w) for clips), else the latent's
            mask, floor = torch.ones(grid or entry["latent"].shape[-2:]), 1.0
        out.append(weights(mask.float(), floor))
    return torch.stack(out)
