"""BucketBatchSampler: determinism, bucket purity, repeats, augmentation and exact resume."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest

from difftune.data.discover import DataSet, Item
from difftune.data.sampler import BucketBatchSampler
from difftune.errors import CheckpointError

BUCKETS = [(64, 64), (96, 48), (48, 96)]


def _items(n: int = 23) -> list[Item]:
    return [
        Item(Path(f"{i}.png"), f"c{i}", (64, 64), BUCKETS[i % 3], 0, i % 2,
             repeats=1 + i % 3, flip=i % 2 == 0, crop="center")
        for i in range(n)
    ]


def _take(sampler: BucketBatchSampler, n: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), n))


def test_deterministic_for_seed_and_epoch() -> None:
    a = BucketBatchSampler(_items(), batch_size=4, seed=7)
    b = BucketBatchSampler(DataSet(items=_items()), batch_size=4, seed=7)
    c = BucketBatchSampler(_items(), batch_size=4, seed=8)
    n = 3 * a.len_epoch
    assert _take(a, n) == _take(b, n)
    assert _take(BucketBatchSampler(_items(), 4, 7), n) != _take(c, n)
    # epochs differ from one another
    plan = BucketBatchSampler(_items(), 4, 7)
    assert plan.epoch_plan(0) != plan.epoch_plan(1)


def test_batches_never_mix_buckets_and_cover_repeats() -> None:
    items = _items()
    sampler = BucketBatchSampler(items, batch_size=4, seed=1)
    for epoch in range(3):
        batches = [b for b in itertools.islice(sampler.batches(), sampler.len_epoch)]
        assert all(b.epoch == epoch for b in batches)
        counts: Counter[int] = Counter()
        for b in batches:
            assert 1 <= len(b.indices) <= 4
            assert len({items[i].bucket for i in b.indices}) == 1
            counts.update(b.indices)
        assert counts == {i: it.repeats for i, it in enumerate(items)}
        # at most one partial batch per bucket
        partial = Counter(items[b.indices[0]].bucket for b in batches if len(b.indices) < 4)
        assert all(v == 1 for v in partial.values())


def test_len_epoch() -> None:
    items = _items()
    per_bucket = Counter()
    for it in items:
        per_bucket[it.bucket] += it.repeats
    expected = sum(-(-n // 5) for n in per_bucket.values())
    sampler = BucketBatchSampler(items, batch_size=5, seed=0)
    assert sampler.len_epoch == expected == len(sampler.epoch_plan(4))


def test_slots_and_flips() -> None:
    items = _items()
    sampler = BucketBatchSampler(items, batch_size=3, seed=2)
    seen: Counter[tuple[int, int]] = Counter()
    flips = []
    for b in itertools.islice(sampler.batches(), sampler.len_epoch):
        for i, k, f, s in zip(b.indices, b.slots, b.flips, b.seeds, strict=True):
            seen[(i, k)] += 1
            assert 0 <= k < items[i].repeats
            assert f == sampler.flip_for(i, b.epoch, k)
            assert s == sampler.seed_for(i, b.epoch, k)
            if not items[i].flip:
                assert f is False
            else:
                flips.append(f)
    assert all(v == 1 for v in seen.values())  # each (item, slot) exactly once
    assert True in flips and False in flips
    # the choice does not depend on batch size
    other = BucketBatchSampler(items, batch_size=7, seed=2)
    assert all(other.flip_for(i, 0, 0) == sampler.flip_for(i, 0, 0) for i in range(len(items)))


@pytest.mark.parametrize("stop", [0, 1, 5, 11, 12, 30])
def test_resume_continues_identical_sequence(stop: int) -> None:
    full = BucketBatchSampler(_items(), batch_size=3, seed=5)
    reference = list(itertools.islice(full.batches(), 40))

    first = BucketBatchSampler(_items(), batch_size=3, seed=5)
    head = list(itertools.islice(first.batches(), stop))
    state = first.state_dict()
    resumed = BucketBatchSampler(_items(), batch_size=3, seed=5)
    resumed.load_state_dict(state)
    tail = list(itertools.islice(resumed.batches(), 40 - stop))
    assert head + tail == reference


def test_state_after_batch_is_robust_to_prefetch() -> None:
    sampler = BucketBatchSampler(_items(), batch_size=3, seed=5)
    gen = sampler.batches()
    trained = [next(gen) for _ in range(4)]
    for _ in range(6):  # prefetched, never trained on
        next(gen)
    resumed = BucketBatchSampler(_items(), batch_size=3, seed=5)
    resumed.load_state_dict(sampler.state_after(trained[-1]))
    reference = list(itertools.islice(BucketBatchSampler(_items(), 3, 5).batches(), 8))
    assert trained + list(itertools.islice(resumed.batches(), 4)) == reference


def test_state_roundtrip_and_mismatch() -> None:
    sampler = BucketBatchSampler(_items(), batch_size=3, seed=5)
    _take(sampler, sampler.len_epoch + 2)
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    with pytest.raises(CheckpointError, match="batch_size"):
        BucketBatchSampler(_items(), batch_size=4, seed=5).load_state_dict(state)
    with pytest.raises(CheckpointError, match="num_items"):
        BucketBatchSampler(_items(10), batch_size=3, seed=5).load_state_dict(state)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        BucketBatchSampler([], batch_size=1, seed=0)
    with pytest.raises(ValueError):
        BucketBatchSampler(_items(), batch_size=0, seed=0)


def test_changed_items_refuse_resume() -> None:
    state = BucketBatchSampler(_items(), batch_size=3, seed=5).state_dict()
    changed = _items()
    changed[0] = Item(Path("other.png"), "c", (64, 64), BUCKETS[0], 0, 0, 1, True, "center")
    with pytest.raises(CheckpointError, match="fingerprint"):
        BucketBatchSampler(changed, batch_size=3, seed=5).load_state_dict(state)
