"""Regularization subsets: the per-epoch balance rule, its determinism and resume state; the
subset options as the config reads them; trigger removal for output preservation."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from difftune.config import DatasetConfig, RunConfig
from difftune.config.preservation import PreservationConfig
from difftune.data.balance import epoch_samples
from difftune.data.discover import Item
from difftune.data.sampler import BucketBatchSampler
from difftune.train.preservation import adapters_off, trigger_free


def _items(train: int, reg: int, reg_repeats: int = 1) -> list[Item]:
    """`train` training items (repeats 2) then `reg` regularization items, two buckets."""
    def item(i: int, is_reg: bool) -> Item:
        return Item(Path(f"{i}.png"), f"c{i}", (64, 64), [(64, 64), (96, 48)][i % 2], 0,
                    int(is_reg), repeats=reg_repeats if is_reg else 2, flip=True, crop="center",
                    regularization=is_reg, loss_weight=0.5 if is_reg else 1.0)
    return [item(i, False) for i in range(train)] + [item(train + j, True) for j in range(reg)]


@pytest.mark.parametrize("train,reg,reg_repeats", [(3, 2, 1), (3, 20, 1), (4, 3, 2)])
def test_each_epoch_holds_as_many_regularization_samples_as_training(
        train: int, reg: int, reg_repeats: int) -> None:
    items = _items(train, reg, reg_repeats)
    for epoch in range(4):
        samples = epoch_samples(items, 5, epoch)
        kinds = Counter(items[i].regularization for i, _ in samples)
        assert kinds[False] == kinds[True] == 2 * train
        assert len(set(samples)) == len(samples)  # a slot names one occurrence in an epoch


def test_a_large_pool_rotates_so_every_image_is_used_evenly() -> None:
    items = _items(3, 12)  # 6 training samples per epoch, 12 regularization images
    used = Counter(i for e in range(4) for i, _ in epoch_samples(items, 1, e)
                   if items[i].regularization)
    assert sorted(used.values()) == [2] * 12  # 24 draws over 12 images: each twice
    first, second = ({i for i, _ in epoch_samples(items, 1, e) if items[i].regularization}
                     for e in (0, 1))
    assert first.isdisjoint(second)  # the cut continues where the last epoch stopped


def test_regularization_repeats_set_the_mix() -> None:
    items = _items(4, 2) + [Item(Path("x.png"), "x", (64, 64), (64, 64), 0, 2, repeats=3,
                                 flip=False, crop="center", regularization=True)]
    used = Counter(i for e in range(5) for i, _ in epoch_samples(items, 0, e)
                   if items[i].regularization)
    assert used[len(items) - 1] == 3 * used[4] == 3 * used[5]


def test_balanced_sampler_is_deterministic_and_resumes_exactly() -> None:
    items = _items(3, 7)
    full = BucketBatchSampler(items, batch_size=3, seed=4)
    every = [(b.indices, b.flips, b.seeds) for b in itertools.islice(full.batches(), 20)]
    again = BucketBatchSampler(items, batch_size=3, seed=4)
    assert every == [(b.indices, b.flips, b.seeds) for b in itertools.islice(again.batches(), 20)]
    first = BucketBatchSampler(items, batch_size=3, seed=4)
    seen = list(itertools.islice(first.batches(), 9))
    resumed = BucketBatchSampler(items, batch_size=3, seed=4)
    resumed.load_state_dict(first.state_after(seen[-1]))
    rest = [(b.indices, b.flips, b.seeds) for b in itertools.islice(resumed.batches(), 11)]
    assert rest == every[9:]
    # Whether an item regularizes is part of the data order's identity.
    plain = [Item(**{**it.__dict__, "regularization": False}) for it in items]
    assert BucketBatchSampler(plain, 3, 4).identity() != full.identity()


def test_a_run_of_regularization_items_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="training item"):
        BucketBatchSampler(_items(0, 3), 2, 0)


def test_prior_loss_weight_is_loss_weight(tmp_path: Path) -> None:
    ds = DatasetConfig(path=tmp_path, regularization=True, prior_loss_weight=0.25)
    assert ds.subsets[0].loss_weight == 0.25 and ds.subsets[0].regularization
    assert DatasetConfig(subsets=[{"path": tmp_path, "loss_weight": 2}]).subsets[0].loss_weight == 2
    with pytest.raises(ValidationError, match="loss_weight"):
        DatasetConfig(path=tmp_path, loss_weight=-1)


@pytest.mark.parametrize("caption,expected", [
    ("a photo of sks dog", "a photo of dog"),
    ("sks, dog, on grass", "dog, on grass"),
    ("a sks dog, sks style", "a dog, style"),
    ("a sksy dog", None),  # whole words only
    ("a dog", None),
])
def test_trigger_removal(caption: str, expected: str | None) -> None:
    assert trigger_free(caption, PreservationConfig(trigger="sks")) == expected


def test_trigger_replacement() -> None:
    cfg = PreservationConfig(trigger="sks dog", replacement="dog")
    assert trigger_free("photo of sks dog.", cfg) == "photo of dog."
    assert trigger_free("anything", PreservationConfig()) is None  # off


def test_adapters_off_switches_only_the_flag() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], init_lora_weights=False),
                                    torch.nn.Sequential(torch.nn.Linear(3, 3)))
    base = torch.nn.functional.linear(torch.ones(1, 3), model[0].base_layer.weight,
                                      model[0].base_layer.bias)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        tuned = model(torch.ones(1, 3))
        with adapters_off([model]):
            assert torch.equal(model(torch.ones(1, 3)), base)
        assert torch.equal(model(torch.ones(1, 3)), tuned) and not torch.equal(tuned, base)
    assert grads == {n: p.requires_grad for n, p in model.named_parameters()}


def test_subset_weights_multiply_the_objectives() -> None:
    from types import SimpleNamespace

    from difftune.train.step import subset_weights

    run = SimpleNamespace(data=SimpleNamespace(items=_items(2, 2)))  # reg items weigh 0.5
    assert subset_weights(run, [0, 1], None) is None  # all ones: nothing to apply
    assert subset_weights(run, [0, 2], None).tolist() == [1.0, 0.5]
    assert subset_weights(run, [3, 1], torch.tensor([2.0, 3.0])).tolist() == [1.0, 3.0]


def _class_config(folder: Path, prompt: str = "a dog") -> "RunConfig":
    from difftune.config import parse_config

    raw = {"model": {"flavor": "tiny"}, "datasets": [{"subsets": [
        {"path": str(folder.parent / "train")},
        {"path": str(folder), "regularization": True, "class_prompt": prompt,
         "class_images": 4}]}], "save": {"dir": str(folder.parent / "out")}}
    return parse_config(raw, folder.parent)


def test_class_images_counted_and_settings_mismatch_refused(tmp_path: Path) -> None:
    from difftune.data import class_images
    from difftune.errors import ConfigError

    folder = tmp_path / "class"
    class_images.make_folders(_class_config(folder))  # made, so discovery finds it
    (folder / "mine.png").write_bytes(b"")
    need, = class_images.needs(_class_config(folder))
    assert (need.existing, need.missing) == (1, 3)
    assert "3 would be generated" in class_images.describe(_class_config(folder))[0]
    manifest = {"settings": {**vars(need.settings)}, "files": {}}
    (folder / class_images.MANIFEST).write_text(json.dumps(manifest))
    class_images.make_folders(_class_config(folder))  # the same settings: accepted
    with pytest.raises(ConfigError, match="prompt: 'a dog' now 'a cat'"):
        class_images.make_folders(_class_config(folder, "a cat"))
    assert (folder / "mine.png").exists()


def test_class_images_need_a_prompt_and_regularization(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="class_prompt"):
        DatasetConfig(path=tmp_path, regularization=True, class_images=2)
    with pytest.raises(ValidationError, match="regularization = true"):
        DatasetConfig(path=tmp_path, class_prompt="a dog", class_images=2)


def test_summary_counts_the_balanced_epoch() -> None:
    from difftune.data.discover import DataSet

    items = _items(3, 20)  # 6 training samples; 6 of the 20 regularization images per epoch
    assert DataSet(items).summary()["samples_per_epoch"] == 12 == len(epoch_samples(items, 0, 0))
    assert DataSet(_items(3, 0)).summary()["samples_per_epoch"] == 6


def test_a_dataset_of_class_images_still_to_generate_is_not_an_error(tmp_path: Path) -> None:
    from difftune.data.discover import build
    from difftune.verbs.demo import demo_dir

    (tmp_path / "class").mkdir()
    train = DatasetConfig(path=demo_dir(), resolution=64, min_side=32, max_side=128)
    classes = DatasetConfig(path=tmp_path / "class", resolution=64, min_side=32, max_side=128,
                            regularization=True, class_prompt="a shape", class_images=2)
    assert len(build([train, classes], 16).items) == len(build([train], 16).items)


def test_loss_parts_reach_tensorboard() -> None:
    from types import SimpleNamespace

    from difftune.report.metrics import Reporter

    written: list[str] = []
    me = SimpleNamespace(writer=SimpleNamespace(add_scalar=lambda k, v, s: written.append(k)))
    Reporter._write_tb(me, {"step": 1, "loss": 1.0, "loss_smoothed": 1.0, "lr": 0.1,
                            "it_per_s": 2.0, "epoch": 0, "loss_preservation": 0.5})
    assert written == ["train/loss", "train/loss_smoothed", "train/lr", "train/it_per_s",
                       "train/loss_preservation"]


def test_a_trigger_in_no_caption_is_noticed() -> None:
    from dataclasses import replace

    from difftune.data.captions import CaptionAugment
    from difftune.train.preservation import unused

    items = _items(2, 1)
    cfg = PreservationConfig(trigger="sks")
    assert unused(items, cfg) and not unused(items, PreservationConfig())
    prefixed = [replace(items[0], augment=replace(CaptionAugment(), prefix="sks"))]
    assert not unused(prefixed, cfg)  # the trigger given as caption_prefix counts
