"""Multi-resolution datasets: the config list, one item per image and resolution, buckets per
resolution, the check report, distinct cache keys, and a single int left exactly as it was."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from difftune.cache.sources import LatentSource
from difftune.config import DatasetConfig
from difftune.data import build
from difftune.data.sampler import BucketBatchSampler
from difftune.verbs.check import _describe_data


def _img(path: Path, w: int, h: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(ord(path.stem[0])).integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)
    path.with_suffix(".txt").write_text(f"image {path.stem}")
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Three images: two square, one landscape."""
    _img(tmp_path / "a.png", 64, 64)
    _img(tmp_path / "b.png", 96, 48)
    _img(tmp_path / "c.png", 64, 64)
    return tmp_path


def _ds(path: Path, resolution: Any, **kw: Any) -> DatasetConfig:
    base = {"resolution": resolution, "min_side": 32, "max_side": 160}
    return DatasetConfig.model_validate({**base, "path": path, **kw})


def test_resolution_takes_an_int_or_a_list_of_distinct_sides(tmp_path: Path) -> None:
    assert _ds(tmp_path, 64).resolutions == (64,)
    assert _ds(tmp_path, [96, 64]).resolutions == (96, 64)
    for bad, words in [([], "empty list"), ([64, 64], "twice"), ([64, 32], "below 64"),
                       ([64, 256], "between min_side (32) and max_side (160)")]:
        with pytest.raises(ValidationError, match=r"(?s)resolution.*" + words.replace("(", r"\(")
                           .replace(")", r"\)")):
            _ds(tmp_path, bad)


def test_each_image_is_one_item_per_resolution_bucketed_there(folder: Path) -> None:
    data = build([_ds(folder, [64, 96], repeats=2)], bucket_step=16)
    got = [(it.path.name, it.resolution, it.bucket) for it in data.items]
    assert got == [("a.png", 64, (64, 64)), ("a.png", 96, (96, 96)),
                   ("b.png", 64, (80, 48)), ("b.png", 96, (128, 64)),
                   ("c.png", 64, (64, 64)), ("c.png", 96, (96, 96))]
    s = data.summary()
    assert s["images"] == 3 and s["samples_per_epoch"] == 6 * 2
    assert s["resolutions"] == {
        "64": {"images": 3, "upscaled": 0, "buckets": {"64x64": 2, "80x48": 1}},
        "96": {"images": 3, "upscaled": 3, "buckets": {"128x64": 1, "96x96": 2}}}
    lines = _describe_data(data)
    assert "  resolution 96: 3 images, 3 upscaled" in lines and "    bucket 128x64: 1" in lines


def test_a_single_int_gives_the_items_and_fingerprint_of_before(folder: Path) -> None:
    data = build([_ds(folder, 64)], bucket_step=16)
    assert [it.resolution for it in data.items] == [64, 64, 64]
    old = [dataclasses.replace(it, resolution=0) for it in data.items]  # items before the field
    assert BucketBatchSampler(data, 2, 3).identity() == BucketBatchSampler(old, 2, 3).identity()
    assert "resolutions" not in data.summary() and data.summary()["images"] == 3
    multi = build([_ds(folder, [64, 96])], bucket_step=16)
    assert BucketBatchSampler(multi, 2, 3).identity()["fingerprint"] != \
        BucketBatchSampler(multi.items[::2] + multi.items[1::2], 2, 3).identity()["fingerprint"]


def test_an_image_that_cannot_cover_one_resolution_is_skipped_there_only(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 9000)  # over 128x64, under 96x96
    data = build([_ds(folder, [64, 96])], bucket_step=16)
    assert [(it.path.name, it.resolution) for it in data.items] == \
        [("a.png", 64), ("b.png", 64), ("b.png", 96), ("c.png", 64)]
    assert [(p.name, why.split(":")[0]) for p, why in data.skipped] == \
        [("a.png", "at resolution 96"), ("c.png", "at resolution 96")]


def test_batches_never_mix_resolutions_buckets(folder: Path) -> None:
    data = build([_ds(folder, [64, 96], buckets=False)], bucket_step=16)
    sampler = BucketBatchSampler(data, 2, 7)
    for _, batch in zip(range(20), sampler.batches()):
        assert len({data.items[i].bucket for i in batch.indices}) == 1


def test_each_resolution_has_its_own_latent_entry_and_random_crop(folder: Path) -> None:
    data = build([_ds(folder, [64, 96], crop="random")], bucket_step=16)
    comps = SimpleNamespace(fingerprint="m", vae=SimpleNamespace(dtype=torch.float32))
    source = LatentSource(SimpleNamespace(name="flux"), comps, data.items, None, seed=3)
    keys = [source._key(i, False)[0] for i in range(len(data.items))]
    assert len(set(keys)) == len(keys)
    again = LatentSource(SimpleNamespace(name="flux"), comps, data.items, None, seed=3)
    assert keys == [again._key(i, False)[0] for i in range(len(data.items))]  # another run hits
    b64, b96 = (source.box(i) for i in (2, 3))  # b.png at 64 and 96: the crops move sideways
    assert b64[1] == 0 and b96[1] == 0 and (b64[2] - b64[0], b96[2] - b96[0]) == (80, 128)
