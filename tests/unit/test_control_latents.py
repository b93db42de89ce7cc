"""Edit pairs through training: control sizes by the family's rule, batches that never mix them,
content-addressed control latents in memory and disk stores, and the refusals at load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from difftune import families
from difftune.cache.controls import ControlSource
from difftune.cache.disk import DiskStore
from difftune.cache.store import MemoryStore
from difftune.config import DatasetConfig, ModelConfig, load_config
from difftune.data import build
from difftune.data.sampler import BucketBatchSampler
from difftune.errors import ConfigError
from difftune.families.flux import kontext


def _img(path: Path, size: tuple[int, int], seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return path


def _pairs(tmp_path: Path) -> DatasetConfig:
    for i, (target, control) in enumerate((((64, 64), (64, 64)), ((64, 64), (96, 48)),
                                           ((64, 64), (48, 96)), ((64, 64), (64, 64)))):
        _img(tmp_path / f"after/{i}.png", target, i)
        _img(tmp_path / f"before/{i}.png", control, 10 + i)
    return DatasetConfig.model_validate({"path": tmp_path / "after", "resolution": 64, "min_side": 32, "max_side": 128,
                                         "control_path": tmp_path / "before"})


def test_control_sizes_follow_the_rule_and_batches_never_mix_them(tmp_path: Path) -> None:
    family = families.get("flux", "kontext")
    data = build([_pairs(tmp_path)], family.bucket_step, family.control_size)
    sizes = {it.path.name: it.control_sizes for it in data.items}
    assert sizes["1.png"] == (kontext.control_size((96, 48), 64),)
    assert sizes["0.png"] == sizes["3.png"] == ((64, 64),)
    sampler = BucketBatchSampler(data, 4, seed=1)
    for _ in range(3 * sampler.len_epoch):
        batch = next(sampler.batches())
        assert len({data.items[i].control_sizes for i in batch.indices}) == 1
    assert sampler.len_epoch == 3  # (64, 64) x2 share one batch, the others one each


def test_runs_without_controls_keep_their_sampler_identity(tmp_path: Path) -> None:
    data = build([DatasetConfig.model_validate({"path": _pairs(tmp_path).subsets[0].path,
                                                "resolution": 64, "min_side": 32,
                                                "max_side": 128})], 16)
    sampler = BucketBatchSampler(data, 2, seed=1)
    # the identity as written before control sizes existed
    from difftune.data.sampler import _hash64

    layout = [(it.path.name, it.bucket, it.repeats) for it in data.items]
    assert sampler.identity()["fingerprint"] == f"{_hash64('items', layout):016x}"


@pytest.mark.parametrize("disk", [False, True])
def test_control_latents_are_cached_by_content(tmp_path: Path, disk: bool) -> None:
    family = families.get("flux", "kontext")
    policy = type("P", (), {"device": torch.device("cpu"), "denoiser_home": torch.device("cpu"),
                            "denoiser": torch.float32, "vae": torch.float32,
                            "text_encoders": torch.float32})()
    comps = family.load(ModelConfig(family="flux", flavor="tiny", variant="kontext"), policy)
    data = build([_pairs(tmp_path)], family.bucket_step, family.control_size)
    store: Any = DiskStore(tmp_path / "cache", "latents") if disk else MemoryStore()
    source = ControlSource(family, comps, data.items, store)
    assert len(source.fill()) == 4 and source.fill() == []
    first = source.batch([1])[0]
    w, h = data.items[1].control_sizes[0]
    assert first.shape == (1, 16, h // 8, w // 8)
    fresh = ControlSource(family, comps, data.items, MemoryStore()).batch([1])[0]
    assert torch.equal(first, fresh)
    keys = source.keys()
    edited = data.items[1].controls[0]
    _img(edited, (96, 48), 99)  # edited: a new entry, by construction
    # An edit lands on a later clock tick than the first read (file hashes are memoized on
    # path, size and mtime); within one tick a same-size rewrite would look unchanged.
    later = edited.stat().st_mtime_ns + 10**9
    os.utime(edited, ns=(later, later))
    assert ControlSource(family, comps, data.items, store).keys() != keys


def test_flip_with_control_path_is_refused_at_load(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[model]\nflavor = "tiny"\nvariant = "kontext"\n[[datasets]]\n'
                      'path = "after"\ncontrol_path = "before"\nflip = true\n'
                      '[save]\ndir = "out"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"subsets\[0\].flip: edit pairs are not mirrored"):
        load_config(config)
    config.write_text(config.read_text().replace("flip = true\n", ""))
    assert load_config(config).model.variant == "kontext"


def test_a_control_damaged_mid_run_skips_its_pair_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from difftune.cache.store import NullStore

    family = families.get("flux", "kontext")
    policy = type("P", (), {"device": torch.device("cpu"), "denoiser_home": torch.device("cpu"),
                            "denoiser": torch.float32, "vae": torch.float32,
                            "text_encoders": torch.float32})()
    comps = family.load(ModelConfig(family="flux", flavor="tiny", variant="kontext"), policy)
    data = build([_pairs(tmp_path)], family.bucket_step, family.control_size)
    source = ControlSource(family, comps, data.items, NullStore())  # cache.latents = "none"
    assert source.readable(0) is not None
    data.items[0].controls[0].write_bytes(b"damaged")
    with caplog.at_level("WARNING", logger="difftune"):
        assert source.readable(0) is None and source.readable(0) is None
    assert caplog.text.count("cannot be read any more") == 1
    assert source.readable(1) is not None
