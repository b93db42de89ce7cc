"""Edit pairs: target images matched to control images by path, skipped pairs named, refusals."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from difftune.config import DatasetConfig, load_config
from difftune.data import build
from difftune.data.discover import DataSet
from difftune.errors import ConfigError, DataError
from difftune.verbs.check import _describe_data


def _img(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return path


def _ds(path: Path, **kw: Any) -> DatasetConfig:
    base = {"resolution": 64, "min_side": 32, "max_side": 128}
    return DatasetConfig.model_validate({**base, "path": path, **kw})


def test_targets_pair_with_controls_of_the_same_relative_path(tmp_path: Path) -> None:
    _img(tmp_path / "after/cat.png")
    _img(tmp_path / "after/red/dog.png")
    before, refs = _img(tmp_path / "before/cat.jpg"), _img(tmp_path / "refs/cat.webp")
    _img(tmp_path / "before/red/dog.png")
    _img(tmp_path / "refs/red/dog.jpeg")
    data = build([_ds(tmp_path / "after", control_path=[tmp_path / "before",
                                                        tmp_path / "refs"])], 16)
    pairs = {it.path.name: it.controls for it in data.items}
    assert pairs["cat.png"] == (before, refs)  # in control_path order
    assert pairs["dog.png"] == (tmp_path / "before/red/dog.png", tmp_path / "refs/red/dog.jpeg")
    assert data.summary()["pairs"] == 2


def test_one_control_folder_may_be_a_string(tmp_path: Path) -> None:
    ds = DatasetConfig.model_validate({"path": "a", "control_path": "b"})
    assert ds.subsets[0].control_path == [Path("b")]


def test_missing_ambiguous_or_unreadable_partners_skip_that_pair_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("ok", "lonely", "twice", "broken"):
        _img(tmp_path / f"after/{name}.png")
    _img(tmp_path / "before/ok.png")
    _img(tmp_path / "before/twice.png")
    _img(tmp_path / "before/twice.jpg")
    (tmp_path / "before/broken.png").write_bytes(b"not an image")
    with caplog.at_level(logging.WARNING, logger="difftune.data"):
        data = build([_ds(tmp_path / "after", control_path=tmp_path / "before")], 16)
    assert [it.path.name for it in data.items] == ["ok.png"]
    why = {p.name: reason for p, reason in data.skipped}
    assert "no control image lonely.*" in why["lonely.png"]
    assert "several control images" in why["twice.png"]
    assert "broken.png is unreadable" in why["broken.png"]
    assert "lonely.png" in caplog.text and "broken.png" in caplog.text


def test_a_subset_with_no_complete_pair_is_an_error(tmp_path: Path) -> None:
    _img(tmp_path / "after/a.png")
    (tmp_path / "before").mkdir()
    with pytest.raises(DataError, match=r"datasets\[0\].subsets\[0\].*no complete edit pair"):
        build([_ds(tmp_path / "after", control_path=tmp_path / "before")], 16)


def test_control_folders_that_are_missing_or_inside_the_targets_are_refused(
        tmp_path: Path) -> None:
    _img(tmp_path / "after/a.png")
    _img(tmp_path / "after/before/a.png")
    with pytest.raises(DataError, match=r"control_path\[0\].*does not exist"):
        build([_ds(tmp_path / "after", control_path=tmp_path / "nowhere")], 16)
    with pytest.raises(DataError, match="trained on as targets"):
        build([_ds(tmp_path / "after", control_path=tmp_path / "after/before")], 16)
    flat = build([_ds(tmp_path / "after", control_path=tmp_path / "after/before",
                      recursive=False)], 16)
    assert [it.controls for it in flat.items] == [(tmp_path / "after/before/a.png",)]


def test_check_reports_the_pairs_and_plain_datasets_stay_as_they_were(tmp_path: Path) -> None:
    _img(tmp_path / "after/a.png")
    _img(tmp_path / "before/a.png")
    paired = build([_ds(tmp_path / "after", control_path=tmp_path / "before")], 16)
    assert "edit pairs: 1 complete (1 control image(s) each)" in _describe_data(paired)
    plain: DataSet = build([_ds(tmp_path / "after")], 16)
    assert "pairs" not in plain.summary()  # resume identities of existing runs unchanged
    assert not any("edit pairs" in line for line in _describe_data(plain))


def test_a_family_without_edit_training_refuses_control_path_at_load(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[model]\nflavor = "tiny"\n[[datasets]]\npath = "after"\n'
                      'control_path = "before"\n[save]\ndir = "out"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"datasets\[0\].subsets\[0\].control_path.*"
                                          "takes no control images"):
        load_config(config)
