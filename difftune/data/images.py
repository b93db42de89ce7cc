"""Reading image files: a cheap but real validity probe, crop boxes, and pixel tensors.

Decoding is strict: a truncated file is an error, never a silently grey-padded image, whatever
another library may have set `PIL.ImageFile.LOAD_TRUNCATED_IMAGES` to. Pixels are produced the
same way every time (EXIF orientation applied, 16-bit gray scaled to 8 bits, alpha composited on
white, LANCZOS resize to cover the bucket, crop, optional mirror), so a cached latent and a
freshly computed one agree. An image whose resize to cover its bucket would be enormous (a tiny
1x600000 PNG becomes gigabytes) is refused like a decompression bomb.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps

from difftune.data.buckets import Bucket, cover_size
from difftune.errors import DataError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp"})
# EXIF orientations 5-8 rotate by 90 degrees, so width and height swap (exif_transpose semantics).
_ORIENTATION_TAG = 0x0112
_SWAPS_SIDES = {5, 6, 7, 8}
_strict_lock = threading.RLock()
_strict_depth = 0
_saved_flag = False


@contextmanager
def strict_decoding() -> Iterator[None]:
    """Turn PIL's LOAD_TRUNCATED_IMAGES off for the duration, restoring the caller's value.

    The flag is process-global; a depth counter under a lock lets several threads probe at once
    while the outermost exit restores whatever value was there before.
    """
    global _strict_depth, _saved_flag
    with _strict_lock:
        if _strict_depth == 0:
            _saved_flag = ImageFile.LOAD_TRUNCATED_IMAGES
        _strict_depth += 1
        ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        with _strict_lock:
            _strict_depth -= 1
            if _strict_depth == 0:
                ImageFile.LOAD_TRUNCATED_IMAGES = _saved_flag


def probe_image(path: Path) -> tuple[int, int]:
    """Check that `path` is a complete, decodable image and return its upright (width, height).

    Raises `ValueError` with a short reason when it is not. Two passes: `verify()` (header and,
    for PNG, chunk checksums) and a real decode, which is what catches truncated JPEG/WebP data.
    JPEGs are decoded in draft mode (DCT scaling, up to 8x smaller) which still reads the whole
    entropy-coded stream, so truncation is caught at a fraction of the full decode cost.
    """
    if path.stat().st_size == 0:
        raise ValueError("empty file (0 bytes)")
    try:
        with strict_decoding(), Image.open(path) as img:
            img.verify()
        with strict_decoding(), Image.open(path) as img:
            w, h = img.size
            orientation = img.getexif().get(_ORIENTATION_TAG)
            if img.format == "JPEG":
                img.draft(img.mode, (max(1, w // 8), max(1, h // 8)))
            img.load()
    except Image.DecompressionBombError as err:
        raise ValueError(f"too large to load safely ({err})") from None
    except Image.UnidentifiedImageError:
        raise ValueError("not a readable image (unknown or corrupt format)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise ValueError(f"corrupt or truncated image ({err})") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"image has no pixels ({w}x{h})")
    return (h, w) if orientation in _SWAPS_SIDES else (w, h)


def crop_box(
    size: tuple[int, int],
    bucket: Bucket,
    mode: Literal["center", "random"],
    rng: random.Random,
) -> tuple[int, int, int, int]:
    """The (left, top, right, bottom) crop of the bucket, in the resized image's coordinates.

    `size` is the original upright size; the image is first resized to `cover_size(size,
    bucket)`. "center" ignores `rng`; "random" draws the offset from it (one draw per axis, in
    x-then-y order, so the box is reproducible from the rng's state).
    """
    rw, rh = cover_size(size, bucket)
    bw, bh = bucket
    if mode == "center":
        left, top = (rw - bw) // 2, (rh - bh) // 2
    elif mode == "random":
        left, top = rng.randint(0, rw - bw), rng.randint(0, rh - bh)
    else:
        raise ValueError(f'crop mode must be "center" or "random", got {mode!r}')
    return (left, top, left + bw, top + bh)


# PIL's modes for one channel of more than 8 bits (16-bit PNGs open as I;16; I is 32-bit).
_WIDE_GRAY = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})
# 16 bits to 8, rounded: v * 255 / 65535 is v / 257 exactly; values outside 0..65535 clip.
_TO_8_BITS = [(v + 128) // 257 for v in range(65536)]


def _to_8_bits(img: Image.Image) -> Image.Image:
    """`img` with 16-bit gray scaled to 8 bits ("L", or "LA" keeping a tRNS transparent value);
    PIL's own conversion clips every value above 255 to white. Other modes are returned as
    they are (PIL already reads 16-bit RGB and gray-with-alpha PNGs as 8-bit RGB / RGBA)."""
    if img.mode not in _WIDE_GRAY:
        return img
    wide = img.convert("I")
    gray = wide.point(_TO_8_BITS, "L")
    key = img.info.get("transparency")
    if not isinstance(key, int):
        return gray
    opaque = wide.point([0 if v == key else 255 for v in range(65536)], "L")
    return Image.merge("LA", (gray, opaque))


def upscale_problem(size: tuple[int, int], bucket: Bucket) -> str | None:
    """Why an image of upright `size` must not be resized to cover `bucket` (None when it may):
    the resized image would hold more pixels than PIL's decompression-bomb limit
    (`PIL.Image.MAX_IMAGE_PIXELS`), which only an extreme aspect ratio reaches."""
    w, h = cover_size(size, bucket)
    limit = Image.MAX_IMAGE_PIXELS
    if not limit or w * h <= limit:
        return None
    return (f"its {size[0]}x{size[1]} pixels would be resized to {w}x{h} to cover the "
            f"{bucket[0]}x{bucket[1]} bucket, over the decompression-bomb limit of {limit} "
            "pixels; crop it to a less extreme aspect ratio")


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB version of `img` (16-bit gray scaled to 8 bits first); any transparency is
    composited over white (not black)."""
    img = _to_8_bits(img)
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def load_pixels(
    path: Path, bucket: Bucket, box: tuple[int, int, int, int], flip: bool
) -> torch.Tensor:
    """Decode `path` into a (3, H, W) float32 tensor in [-1, 1] for `bucket` = (W, H).

    Steps: EXIF orientation, RGB (alpha over white), LANCZOS resize to cover the bucket
    (`reducing_gap` first shrinks large images by integer factors, which is much faster and
    visually equivalent), crop `box` (from `crop_box`), mirror left-right when `flip`.
    """
    with strict_decoding(), Image.open(path) as raw:
        img = _to_rgb(ImageOps.exif_transpose(raw))
    return fit_pixels(img, bucket, box, flip, path)


def fit_pixels(img: Image.Image, bucket: Bucket, box: tuple[int, int, int, int], flip: bool,
               path: Path) -> torch.Tensor:
    """An upright RGB image (an image file's, or a video frame) -> (3, H, W) float32 in
    [-1, 1]: LANCZOS resize to cover `bucket`, crop `box`, mirror when `flip`. `path` names
    the file in errors."""
    why = upscale_problem(img.size, bucket)
    if why:
        raise DataError(f"image {path}: {why}")
    target = cover_size(img.size, bucket)
    if img.size != target:
        img = img.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
    img = img.crop(box)
    if img.size != tuple(bucket):
        raise ValueError(f"crop box {box} does not give bucket {bucket} for {path}")
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    array = np.asarray(img, dtype=np.uint8)  # (H, W, 3)
    pixels = torch.from_numpy(array.copy()).permute(2, 0, 1).float()
    return pixels / 127.5 - 1.0


def load_rgb(path: Path) -> Image.Image:
    """An image file decoded strictly, EXIF orientation applied, as RGB (alpha over white):
    the decoding every training image gets, for input images handed to a pipeline."""
    with strict_decoding(), Image.open(path) as raw:
        return _to_rgb(ImageOps.exif_transpose(raw))


def load_control_pixels(path: Path, size: tuple[int, int], fit: tuple[int, int] | None = None,
                        image: Image.Image | None = None) -> torch.Tensor:
    """Decode a control image into a (1, 3, H, W) float32 batch in [-1, 1] for `size` = (W, H).

    Decoded as `load_pixels` decodes (EXIF orientation, RGB with alpha over white; `image` is
    that decoding when the caller already has it), then resized to `size` with LANCZOS,
    without cropping: an edit pipeline stretches its input image to the chosen size (diffusers'
    VaeImageProcessor.resize), so the control is trained as it is sampled. With `fit`, for a
    pipeline that crops instead, it is resized to `fit` and center-cropped to `size`. An image
    already at the size it is resized to is not resampled at all.
    """
    img = image if image is not None else load_rgb(path)
    scaled = tuple(fit) if fit is not None else tuple(size)
    if img.size != scaled:
        img = img.resize(scaled, Image.Resampling.LANCZOS)
    if img.size != tuple(size):
        left, top = (img.size[0] - size[0]) // 2, (img.size[1] - size[1]) // 2
        img = img.crop((left, top, left + size[0], top + size[1]))
    # The pipeline's arithmetic (VaeImageProcessor: /255 in float32, then 2x - 1) and memory
    # layout (a channels-last batch: the VAE's convolutions round differently on another
    # layout), so the control latents equal the pipeline's bit for bit.
    array = np.asarray(img, dtype=np.uint8).astype(np.float32)[None] / 255.0
    return 2.0 * torch.from_numpy(array).permute(0, 3, 1, 2) - 1.0
