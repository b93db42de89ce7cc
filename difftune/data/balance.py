"""Which samples an epoch holds: every training item `repeats` times, and as many
regularization samples as training samples (DreamBooth's class images).

The rule (sd-scripts' balance, made to rotate): regularization items form one pool, each item
`repeats` times (its subset's repeats set its share of the mix), in an order shuffled once from
the run's seed. The pool is read as an endless ring; epoch e takes the N samples at positions
[e*N, (e+1)*N), N being the epoch's number of training samples. A pool smaller than N is cycled
within the epoch; a larger one is cut, and the next epoch continues where this one stopped, so
every regularization image is used as often as the others over the run. A pure function of
(items, seed, epoch): resuming needs nothing more than the sampler's (epoch, position).

A sample is (item index, slot): the slot numbers the occurrences of an item (unique within an
epoch) and, with the epoch, seeds its flip and crop.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from difftune.data.discover import Item

Sample = tuple[int, int]


def _seed(*parts: object) -> int:
    """A stable 64-bit seed from `parts` (the same in every process)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def training_samples(items: Sequence[Item]) -> list[Sample]:
    """Each training (not regularization) item `repeats` times, slots 0..repeats-1."""
    return [(i, k) for i, it in enumerate(items) if not it.regularization
            for k in range(it.repeats)]


def regularization_pool(items: Sequence[Item], seed: int) -> list[Sample]:
    """The regularization ring: each such item `repeats` times, shuffled once from `seed`."""
    pool = [(i, k) for i, it in enumerate(items) if it.regularization for k in range(it.repeats)]
    random.Random(_seed("regularization", seed)).shuffle(pool)
    return pool


def regularization_samples(items: Sequence[Item], seed: int, epoch: int,
                           count: int) -> list[Sample]:
    """The `count` regularization samples of `epoch` (none when there is no such item).

    Position j of the ring is pool[j % P]; its slot is `k + repeats * (j // P)`, so an item
    met again in a later turn of the ring gets a new slot (its own flip and crop)."""
    pool = regularization_pool(items, seed)
    if not pool:
        return []
    size = len(pool)
    out = []
    for j in range(epoch * count, (epoch + 1) * count):
        i, k = pool[j % size]
        out.append((i, k + items[i].repeats * (j // size)))
    return out


def epoch_samples(items: Sequence[Item], seed: int, epoch: int) -> list[Sample]:
    """Every sample of `epoch`, unordered: the training ones, then the regularization ones."""
    train = training_samples(items)
    return train + regularization_samples(items, seed, epoch, len(train))
