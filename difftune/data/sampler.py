"""Batches that never mix buckets (nor control-image sizes), in an order fixed by (seed,
epoch), resumable exactly.

Each epoch every item appears `repeats` times, and regularization items as often as the
training ones together (`balance.py`). The expanded list is shuffled with a generator
seeded from (seed, epoch), grouped by bucket (keeping the shuffled order inside a bucket), cut
into batches of `batch_size` (a bucket's last, partial batch is kept, so no image is dropped),
and the batch order is shuffled with the same generator. Epoch plans are pure functions of
(items, batch_size, seed, epoch), so resuming needs only (epoch, position).

Augmentation is decided per *occurrence*: the k-th appearance of item i in epoch e (its "slot",
0 <= k < repeats) gets a flip and a crop seed hashed from (seed, e, i, k). The decision does not
depend on batch size or on how far the run has got, so a resumed run sees the same variants.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from difftune.data.balance import epoch_samples
from difftune.data.discover import DataSet, Item
from difftune.errors import CheckpointError


def _hash64(*parts: object) -> int:
    """A stable 64-bit integer from `parts` (unlike hash(), the same in every process)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Batch:
    """One batch: item indices plus what is needed to prepare and to resume after it.

    `slots[j]` is the occurrence number of `indices[j]` in this epoch, `flips[j]` whether that
    sample is mirrored (always False for items whose subset has flip off), `seeds[j]` a seed for
    that sample's other random choices (e.g. `random.Random(seeds[j])` for a random crop).
    `position` is this batch's number within `epoch`.
    """

    epoch: int
    position: int
    indices: tuple[int, ...]
    slots: tuple[int, ...]
    flips: tuple[bool, ...]
    seeds: tuple[int, ...]


Group = tuple[tuple[int, int], tuple[tuple[int, int], ...]] | tuple[
    tuple[int, int], tuple[tuple[int, int], ...], int]


def group_of(item: Item) -> Group:
    """What a batch must share: the bucket, the control images' sizes (so the control
    latents of a batch stack) and, for a clip, its frame count (buckets are (width, height,
    frames)). Images group as before frames existed: (bucket, control sizes), which sorts
    before the clips of the same size."""
    if item.clip is None:
        return (item.bucket, item.control_sizes)
    return (item.bucket, item.control_sizes, item.clip.frames)


class BucketBatchSampler:
    """Infinite, deterministic, resumable bucketed batch sampler over a `DataSet`'s items.

    `iter(sampler)` yields lists of item indices forever, epoch after epoch, starting at the
    current state; `batches()` yields full `Batch` records the same way. Both advance the
    sampler's state as they go, so `state_dict()` taken after receiving a batch resumes right
    after it. When batches are prefetched (e.g. a DataLoader with workers), save
    `state_after(batch)` of the batch actually trained on instead.
    """

    def __init__(self, data: DataSet | Sequence[Item], batch_size: int, seed: int) -> None:
        """`data`: the items (or a DataSet); `batch_size` >= 1; `seed`: the run's seed."""
        items = data.items if isinstance(data, DataSet) else list(data)
        if not items:
            raise ValueError("BucketBatchSampler needs at least one item")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if all(it.regularization for it in items):
            raise ValueError("BucketBatchSampler needs a training item besides the "
                             "regularization ones")
        self.items: list[Item] = list(items)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._plan_epoch: int | None = None
        self._plan: list[list[tuple[int, int]]] = []

    @property
    def len_epoch(self) -> int:
        """Batches in the current epoch (the same every epoch unless regularization samples,
        which rotate, fall in other buckets from one epoch to the next)."""
        per_bucket: dict[Group, int] = {}
        for i, _ in epoch_samples(self.items, self.seed, self.epoch):
            per_bucket[group_of(self.items[i])] = per_bucket.get(group_of(self.items[i]), 0) + 1
        return sum(-(-n // self.batch_size) for n in per_bucket.values())

    def epoch_plan(self, epoch: int) -> list[list[tuple[int, int]]]:
        """The batches of `epoch` as lists of (item index, slot) pairs; cached for one epoch."""
        if self._plan_epoch == epoch:
            return self._plan
        rng = random.Random(_hash64("order", self.seed, epoch))
        samples = epoch_samples(self.items, self.seed, epoch)
        rng.shuffle(samples)
        by_bucket: dict[Group, list[tuple[int, int]]] = {}
        for sample in samples:
            by_bucket.setdefault(group_of(self.items[sample[0]]), []).append(sample)
        plan = []
        for bucket in sorted(by_bucket):  # sorted: independent of dict insertion order
            group = by_bucket[bucket]
            plan += [group[j : j + self.batch_size] for j in range(0, len(group), self.batch_size)]
        rng.shuffle(plan)
        self._plan_epoch, self._plan = epoch, plan
        return plan

    def flip_for(self, item_index: int, epoch: int, slot: int) -> bool:
        """Whether occurrence `slot` of item `item_index` in `epoch` is mirrored.

        False when the item's subset has flip off; otherwise a fair coin hashed from
        (seed, epoch, item, slot), so the same sample flips the same way after a resume.
        """
        if not self.items[item_index].flip:
            return False
        return _hash64("flip", self.seed, epoch, item_index, slot) & 1 == 1

    def seed_for(self, item_index: int, epoch: int, slot: int) -> int:
        """A per-sample seed for other random choices (random crop), like `flip_for`."""
        return _hash64("sample", self.seed, epoch, item_index, slot)

    def batches(self) -> Iterator[Batch]:
        """Infinite generator of `Batch` records from the current (epoch, position) on.

        The state is advanced before each batch is handed out, so it always names the next
        batch to produce.
        """
        while True:
            plan = self.epoch_plan(self.epoch)
            if self.position >= len(plan):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            epoch, position = self.epoch, self.position
            pairs = plan[position]
            self.position += 1
            yield Batch(
                epoch=epoch,
                position=position,
                indices=tuple(i for i, _ in pairs),
                slots=tuple(k for _, k in pairs),
                flips=tuple(self.flip_for(i, epoch, k) for i, k in pairs),
                seeds=tuple(self.seed_for(i, epoch, k) for i, k in pairs),
            )

    def __iter__(self) -> Iterator[list[int]]:
        """Infinite iterator of item-index lists (the `batch_sampler` protocol of DataLoader)."""
        for batch in self.batches():
            yield list(batch.indices)

    def identity(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same batches.

        The fingerprint covers each item's file name, bucket and repeats (not the full path, so
        a dataset folder that moved still resumes), and its resolution when there are several.
        """
        layout: list[tuple[Any, ...]] = [(it.path.name, it.bucket, it.repeats)
                                         for it in self.items]
        if any(it.control_sizes for it in self.items):  # runs without controls: as before
            layout = [(*row, it.control_sizes) for row, it in zip(layout, self.items)]
        if any(it.regularization for it in self.items):  # likewise without regularization
            layout = [(*row, it.regularization) for row, it in zip(layout, self.items)]
        if len({it.resolution for it in self.items}) > 1:  # single resolution: as before
            layout = [(*row, it.resolution) for row, it in zip(layout, self.items)]
        return {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_items": len(self.items),
            "fingerprint": f"{_hash64('items', layout):016x}",
        }

    def state_dict(self) -> dict[str, Any]:
        """The resume state: the next batch's (epoch, position) plus the sampler's identity."""
        return {"epoch": self.epoch, "position": self.position, **self.identity()}

    def state_after(self, batch: Batch) -> dict[str, Any]:
        """The state that resumes right after `batch` (robust to prefetching ahead)."""
        return {"epoch": batch.epoch, "position": batch.position + 1, **self.identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`; refuses one made for other data or settings."""
        mine = self.identity()
        diff = [f"{k} {state.get(k)} -> {v}" for k, v in mine.items() if state.get(k) != v]
        if diff:
            raise CheckpointError(
                f"the checkpoint's data order does not match this run ({', '.join(diff)}); "
                "resume with the same datasets, batch size and seed, or start a new run"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
