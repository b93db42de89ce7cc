"""Discovery: images, captions, skipped files, errors, and the DataSet summary."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from difftune.config import DatasetConfig
from difftune.data import build
from difftune.data.discover import list_images, read_caption
from difftune.errors import DataError


def _img(path: Path, w: int = 32, h: int = 32, fmt: str | None = None) -> Path:
    """A small noisy image (noise so that truncation cuts real compressed data)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(w * 1000 + h).integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format=fmt)
    return path


def _truncated(path: Path, fmt: str) -> Path:
    buf = io.BytesIO()
    arr = np.random.default_rng(1).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    Image.fromarray(arr).save(buf, fmt)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def _ds(path: Path, **kw: Any) -> DatasetConfig:
    base = {"resolution": 64, "min_side": 32, "max_side": 128}
    return DatasetConfig.model_validate({**base, "path": path, **kw})


def test_captions_read_and_stripped(tmp_path: Path) -> None:
    _img(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("  a red cube \n", encoding="utf-8")
    _img(tmp_path / "b.JPG", fmt="JPEG")
    (tmp_path / "b.txt").write_bytes("\ufeffcafé au lait\n".encode("utf-8"))  # BOM
    data = build([_ds(tmp_path)], bucket_step=16)
    assert [(it.path.name, it.caption) for it in data.items] == [
        ("a.png", "a red cube"),
        ("b.JPG", "café au lait"),
    ]
    assert data.missing_captions == [] and data.skipped == []


def test_caption_ext_without_dot_and_custom(tmp_path: Path) -> None:
    _img(tmp_path / "a.png")
    (tmp_path / "a.caption").write_text("hello", encoding="utf-8")
    assert read_caption(tmp_path / "a.png", "caption") == "hello"
    assert read_caption(tmp_path / "a.png", ".caption") == "hello"
    assert read_caption(tmp_path / "a.png", ".txt") is None


def test_non_utf8_caption_is_data_error(tmp_path: Path) -> None:
    _img(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="a.txt.*UTF-8"):
        build([_ds(tmp_path)], bucket_step=16)


def test_missing_caption_warns_and_uses_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _img(tmp_path / "a.png")
    with caplog.at_level(logging.WARNING, logger="difftune.data"):
        data = build([_ds(tmp_path, default_caption="photo of sks")], bucket_step=16)
    assert data.items[0].caption == "photo of sks"
    assert data.missing_captions == [tmp_path / "a.png"]
    assert "a.png" in caplog.text and "photo of sks" in caplog.text


def _bad_folder(tmp_path: Path) -> Path:
    _img(tmp_path / "good.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.jpg").write_bytes(b"this is not an image at all")
    _truncated(tmp_path / "cut.png", "PNG")
    _truncated(tmp_path / "cut.jpg", "JPEG")
    return tmp_path


def test_bad_files_skipped_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _bad_folder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="difftune.data"):
        data = build([_ds(folder)], bucket_step=16)
    assert [it.path.name for it in data.items] == ["good.png"]
    reasons = {p.name: why for p, why in data.skipped}
    assert set(reasons) == {"empty.png", "junk.jpg", "cut.png", "cut.jpg"}
    assert "0 bytes" in reasons["empty.png"]
    assert "truncated" in reasons["cut.png"] and "truncated" in reasons["cut.jpg"]
    for name in reasons:
        assert name in caplog.text
    assert data.summary()["skipped"] == 4


def test_many_files_probed_in_parallel_keep_order(tmp_path: Path) -> None:
    names = [f"{i:02d}.png" for i in range(12)]
    for i, name in enumerate(names):
        if i == 5:
            _truncated(tmp_path / name, "PNG")
        else:
            _img(tmp_path / name, 32 + i, 32)
    data = build([_ds(tmp_path)], bucket_step=16)
    assert [it.path.name for it in data.items] == [n for i, n in enumerate(names) if i != 5]
    assert [it.size for it in data.items] == [(32 + i, 32) for i in range(12) if i != 5]


def test_nonexistent_folder_is_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"datasets\[0\]\.subsets\[0\]\.path.*nope.*does not exist"):
        build([_ds(tmp_path / "nope")], bucket_step=16)


def test_empty_folder_is_data_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=str(tmp_path)):
        build([_ds(tmp_path)], bucket_step=16)


def test_only_bad_images_error_lists_reasons(tmp_path: Path) -> None:
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(DataError, match="empty.png: empty file"):
        build([_ds(tmp_path)], bucket_step=16)


def test_recursive_and_not(tmp_path: Path) -> None:
    _img(tmp_path / "top.png")
    _img(tmp_path / "sub" / "deep.webp", fmt="WEBP")
    _img(tmp_path / ".hidden" / "x.png")
    _img(tmp_path / "._y.png")
    assert [p.name for p in list_images(tmp_path, True)] == ["deep.webp", "top.png"]
    assert [p.name for p in list_images(tmp_path, False)] == ["top.png"]
    flat = build([_ds(tmp_path, recursive=False)], bucket_step=16)
    assert [it.path.name for it in flat.items] == ["top.png"]


def test_subsets_repeats_and_settings(tmp_path: Path) -> None:
    _img(tmp_path / "a" / "1.png", 64, 32)
    _img(tmp_path / "b" / "2.png", 32, 64)
    _img(tmp_path / "b" / "3.png", 32, 32)
    ds = DatasetConfig.model_validate({
        "resolution": 64, "min_side": 32, "max_side": 128,
        "subsets": [
            {"path": tmp_path / "a", "repeats": 3, "flip": True, "crop": "random"},
            {"path": tmp_path / "b"},
        ],
    })
    data = build([ds, _ds(tmp_path / "a", buckets=False)], bucket_step=16)
    a, b2, b3, a_again = data.items
    assert (a.dataset, a.subset, a.repeats, a.flip, a.crop) == (0, 0, 3, True, "random")
    assert (b2.dataset, b2.subset, b2.repeats, b2.flip, b2.crop) == (0, 1, 1, False, "center")
    assert a.size == (64, 32) and a.bucket[0] > a.bucket[1]
    assert b2.bucket[0] < b2.bucket[1] and b3.bucket == (64, 64)
    assert a_again.dataset == 1 and a_again.bucket == (64, 64)  # no-bucket mode: square
    s = data.summary()
    assert s["images"] == 4 and s["samples_per_epoch"] == 3 + 1 + 1 + 1
    assert s["subsets"] == {
        "datasets[0].subsets[0]": 1, "datasets[0].subsets[1]": 2, "datasets[1].subsets[0]": 1
    }
    assert sum(s["buckets"].values()) == 4 and s["buckets"]["64x64"] == 2
    assert s["captions_missing"] == 4


def test_dataset_bucket_step_overrides_family_default(tmp_path: Path) -> None:
    _img(tmp_path / "a.png", 300, 100)
    data = build([_ds(tmp_path, bucket_step=32)], bucket_step=8)
    assert all(side % 32 == 0 for side in data.items[0].bucket)
    data8 = build([_ds(tmp_path)], bucket_step=8)
    assert all(side % 8 == 0 for side in data8.items[0].bucket)
    assert data8.summary()["upscaled"] == 0


def test_upscaled_counted(tmp_path: Path) -> None:
    _img(tmp_path / "tiny.png", 8, 8)
    assert build([_ds(tmp_path)], bucket_step=16).summary()["upscaled"] == 1


def test_an_image_that_would_upscale_enormously_is_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 1x600000 PNG is a few KB, but covering its 32x128 bucket makes it 32x19200000 (614 M
    pixels): skipped with the reason, like a decompression bomb."""
    _img(tmp_path / "good.png")
    Image.new("L", (1, 600_000), 128).save(tmp_path / "line.png")
    with caplog.at_level(logging.WARNING, logger="difftune.data"):
        data = build([_ds(tmp_path)], bucket_step=16)
    assert [it.path.name for it in data.items] == ["good.png"]
    reasons = {p.name: why for p, why in data.skipped}
    assert set(reasons) == {"line.png"} and "decompression-bomb limit" in reasons["line.png"]
    assert "32x19200000" in reasons["line.png"] and "line.png" in caplog.text
