"""Image probing, crop boxes and pixel tensors."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from difftune.data.buckets import cover_size
from difftune.data.images import crop_box, load_pixels, probe_image, strict_decoding
from difftune.errors import DataError


def _save(path: Path, img: Image.Image, **kw: object) -> Path:
    img.save(path, **kw)
    return path


def _gradient(w: int, h: int) -> Image.Image:
    """Left half black, right half white (so a flip is visible)."""
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[:, w // 2 :] = 255
    return Image.fromarray(arr)


def test_probe_returns_size(tmp_path: Path) -> None:
    assert probe_image(_save(tmp_path / "a.png", _gradient(40, 30))) == (40, 30)


def test_probe_respects_exif_orientation(tmp_path: Path) -> None:
    img = _gradient(40, 30)
    exif = img.getexif()
    exif[0x0112] = 6  # rotated 90 degrees: upright size is 30x40
    path = _save(tmp_path / "r.jpg", img, exif=exif.tobytes())
    assert probe_image(path) == (30, 40)
    pixels = load_pixels(path, (16, 16), crop_box((30, 40), (16, 16), "center", random.Random()),
                         False)
    assert pixels.shape == (3, 16, 16)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_probe_rejects_truncated_even_if_flag_set(tmp_path: Path, fmt: str) -> None:
    buf = io.BytesIO()
    arr = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(buf, fmt)
    path = tmp_path / "t.img"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) * 3 // 4])
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        with pytest.raises(ValueError, match="truncated"):
            probe_image(path)
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's value is restored
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_strict_decoding_nests() -> None:
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        with strict_decoding():
            with strict_decoding():
                assert ImageFile.LOAD_TRUNCATED_IMAGES is False
            assert ImageFile.LOAD_TRUNCATED_IMAGES is False
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_crop_box_center_and_random() -> None:
    size, bucket = (300, 100), (64, 64)
    rw, rh = cover_size(size, bucket)
    assert (rw, rh) == (192, 64)
    assert crop_box(size, bucket, "center", random.Random(0)) == (64, 0, 128, 64)
    boxes = {crop_box(size, bucket, "random", random.Random(s)) for s in range(20)}
    assert len(boxes) > 1
    for left, top, right, bottom in boxes:
        assert right - left == 64 and bottom - top == 64
        assert 0 <= left and right <= rw and top == 0
    assert crop_box(size, bucket, "random", random.Random(3)) == crop_box(
        size, bucket, "random", random.Random(3)
    )
    with pytest.raises(ValueError):
        crop_box(size, bucket, "middle", random.Random(0))  # type: ignore[arg-type]


def test_load_pixels_shape_range_flip(tmp_path: Path) -> None:
    path = _save(tmp_path / "g.png", _gradient(64, 32))
    bucket = (32, 16)
    box = crop_box((64, 32), bucket, "center", random.Random(0))
    x = load_pixels(path, bucket, box, flip=False)
    assert x.shape == (3, 16, 32) and x.dtype == torch.float32
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert x[:, :, 0].max() == -1.0 and x[:, :, -1].min() == 1.0  # black left, white right
    y = load_pixels(path, bucket, box, flip=True)
    assert torch.equal(y, x.flip(-1))
    assert torch.equal(load_pixels(path, bucket, box, flip=False), x)  # deterministic


def test_load_pixels_upscales_small_image(tmp_path: Path) -> None:
    path = _save(tmp_path / "s.png", _gradient(8, 8))
    x = load_pixels(path, (32, 32), (0, 0, 32, 32), flip=False)
    assert x.shape == (3, 32, 32)


def test_alpha_composited_on_white(tmp_path: Path) -> None:
    path = _save(tmp_path / "a.png", Image.new("RGBA", (16, 16), (0, 0, 0, 0)))
    x = load_pixels(path, (16, 16), (0, 0, 16, 16), flip=False)
    assert torch.all(x == 1.0)
    la = _save(tmp_path / "la.png", Image.new("LA", (16, 16), (0, 0)))
    assert torch.all(load_pixels(la, (16, 16), (0, 0, 16, 16), flip=False) == 1.0)


def test_grayscale_and_palette_become_rgb(tmp_path: Path) -> None:
    gray = _save(tmp_path / "g.png", Image.new("L", (16, 16), 0))
    pal = _save(tmp_path / "p.png", Image.new("RGB", (16, 16), (255, 0, 0)).convert("P"))
    assert torch.all(load_pixels(gray, (16, 16), (0, 0, 16, 16), False) == -1.0)
    red = load_pixels(pal, (16, 16), (0, 0, 16, 16), False)
    assert red.shape == (3, 16, 16) and torch.all(red[0] == 1.0) and torch.all(red[1] == -1.0)


def _png_16bit_gray(path: Path, values: np.ndarray, transparent: int | None = None) -> Path:
    """A 16-bit grayscale PNG written byte by byte (optionally with a tRNS key), as a scanner
    or a 16-bit export makes it; PIL opens it as mode I;16."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    h, w = values.shape
    rows = b"".join(b"\x00" + values[y].astype(">u2").tobytes() for y in range(h))
    trns = chunk(b"tRNS", struct.pack(">H", transparent)) if transparent is not None else b""
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 0, 0, 0, 0))
                     + trns + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return path


WIDE = np.array([[0, 16448, 32896, 65535]], dtype=np.uint16)  # 8-bit 0, 64, 128, 255 x 257


@pytest.mark.parametrize("mode, suffix", [("I;16", ".png"), ("I;16B", ".tif"), ("I", ".tif")])
def test_16_bit_images_train_as_the_picture_they_are(tmp_path: Path, mode: str,
                                                     suffix: str) -> None:
    """16-bit values were clipped to 255 (a near-white picture); they are scaled to 8 bits."""
    path = tmp_path / f"wide{suffix}"
    if suffix == ".png":
        _png_16bit_gray(path, WIDE)
    elif mode == "I":
        Image.fromarray(WIDE.astype(np.int32)).save(path)
    else:
        Image.frombytes(mode, (4, 1), WIDE.astype(">u2").tobytes()).save(path)
    with Image.open(path) as img:
        assert img.mode == mode
    x = load_pixels(path, (4, 1), (0, 0, 4, 1), flip=False)
    expected = torch.tensor([0, 64, 128, 255]).float() / 127.5 - 1.0
    assert torch.equal(x, expected.expand(3, 1, 4))


def test_16_bit_transparency_is_white(tmp_path: Path) -> None:
    path = _png_16bit_gray(tmp_path / "t.png", WIDE, transparent=16448)
    x = load_pixels(path, (4, 1), (0, 0, 4, 1), flip=False)
    expected = torch.tensor([0, 255, 128, 255]).float() / 127.5 - 1.0
    assert torch.equal(x, expected.expand(3, 1, 4))


def test_an_enormous_upscale_is_refused(tmp_path: Path) -> None:
    """A 1x600000 PNG (a few KB) would be resized to cover a 32x128 bucket as 32x19200000."""
    path = _save(tmp_path / "line.png", Image.new("L", (1, 600_000), 128))
    with pytest.raises(DataError, match="decompression"):
        load_pixels(path, (32, 128), (0, 0, 32, 128), flip=False)
