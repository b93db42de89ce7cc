"""Latents and text embeddings for a batch, served from a store or computed on a miss.

Batches ask by item and variant (flip, crop box) or by exact caption text, never by step: the
key is derived from content, so the same request always gets the same entry. `fill_*` computes
every entry a run will need up front, with progress, so training never waits on the VAE or the
text encoders when caching is on.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Callable, Iterable

import torch

from difftune.cache.keys import entry_key, latent_fields, text_fields
from difftune.cache.store import Store
from difftune.data.discover import Item
from difftune.data.images import crop_box, load_pixels
from difftune.families.base import Components, Family, TextEmbeds

Progress = Callable[[Iterable, str, int], Iterable]


def _no_progress(it: Iterable, desc: str, total: int) -> Iterable:
    return it


class LatentSource:
    """VAE latents of dataset items, by (item index, flip)."""

    def __init__(self, family: Family, comps: Components, items: list[Item], store: Store,
                 seed: int, fresh_crops: bool = False) -> None:
        """`fresh_crops`: draw a new random crop for every occurrence (only when not caching)."""
        self.family, self.comps, self.items, self.store = family, comps, items, store
        self.seed, self.fresh_crops = seed, fresh_crops
        self.dtype = str(comps.vae.dtype).removeprefix("torch.")
        # Keys are derived once per (item, flip): hashing image bytes every step would cost
        # more than the cache saves on small models.
        self._keys: dict[tuple[int, bool], tuple[str, dict[str, object]]] = {}

    def box(self, index: int) -> tuple[int, int, int, int]:
        """The item's cached crop box; a "random" crop is drawn once per item from the run seed."""
        item = self.items[index]
        rng = random.Random(f"{self.seed}:{index}")
        return crop_box(item.size, item.bucket, item.crop, rng)

    def _fields(self, index: int, flip: bool) -> dict[str, object]:
        item = self.items[index]
        return latent_fields(family=self.family.name, fingerprint=self.comps.fingerprint,
                             dtype=self.dtype, image=item.path, bucket=item.bucket,
                             box=self.box(index), flip=flip)

    def _key(self, index: int, flip: bool) -> tuple[str, dict[str, object]]:
        if (index, flip) not in self._keys:
            fields = self._fields(index, flip)
            self._keys[index, flip] = entry_key(fields), fields
        return self._keys[index, flip]

    def crop_for(self, index: int, sample_seed: int | None = None) -> tuple[int, int, int, int]:
        """The crop box a sample of item `index` uses (fresh per sample only with `fresh_crops`)."""
        item = self.items[index]
        if self.fresh_crops and item.crop == "random" and sample_seed is not None:
            return crop_box(item.size, item.bucket, "random", random.Random(sample_seed))
        return self.box(index)

    def get(self, index: int, flip: bool, sample_seed: int | None = None) -> torch.Tensor:
        """Latent (C, h, w) of item `index`, horizontally flipped or not.

        With `fresh_crops`, a random-crop item gets a crop drawn from `sample_seed` (the
        sampler's per-occurrence seed) and is encoded live, never cached.
        """
        item = self.items[index]
        box = self.crop_for(index, sample_seed)
        if box != self.box(index):
            return self._encode(item, box, flip)
        key, fields = self._key(index, flip)
        hit = self.store.get(key)
        if hit is not None:
            return hit["latent"]
        latent = self._encode(item, box, flip)
        self.store.put(key, {"latent": latent}, {k: str(v) for k, v in fields.items()})
        return latent

    def _encode(self, item: Item, box: tuple[int, int, int, int], flip: bool) -> torch.Tensor:
        pixels = load_pixels(item.path, item.bucket, box, flip)
        return self.family.encode_images(self.comps, pixels[None])[0].float().cpu()

    def fill(self, progress: Progress = _no_progress) -> None:
        """Compute every variant the run can ask for (both flips where flip is on)."""
        wanted = [(i, f) for i, it in enumerate(self.items)
                  for f in ((False, True) if it.flip else (False,))]
        for i, f in progress(wanted, "caching latents", len(wanted)):
            self.get(i, f)


class TextSource:
    """Text-encoder outputs by exact caption text."""

    def __init__(self, family: Family, comps: Components, store: Store) -> None:
        self.family, self.comps, self.store = family, comps, store
        encoder = next(iter(comps.text_encoders.values()))
        self.dtype = str(encoder.dtype).removeprefix("torch.")
        lengths = comps.extras.get("max_length", {})
        self.encoders = [dict(asdict(s), max_length=lengths.get(s.name, s.max_length))
                         for s in family.text_encoders]
        self._keys: dict[str, tuple[str, dict[str, object]]] = {}

    def _key(self, caption: str) -> tuple[str, dict[str, object]]:
        if caption not in self._keys:
            fields = text_fields(family=self.family.name, fingerprint=self.comps.fingerprint,
                                 dtype=self.dtype, caption=caption, encoders=self.encoders)
            self._keys[caption] = entry_key(fields), fields
        return self._keys[caption]

    def get(self, captions: list[str]) -> TextEmbeds:
        """Embeddings for a batch of captions (CPU tensors), encoding only the misses."""
        found: dict[str, TextEmbeds] = {}
        missing: list[str] = []
        for cap in dict.fromkeys(captions):
            hit = self.store.get(self._key(cap)[0])
            if hit is None:
                missing.append(cap)
            else:
                found[cap] = TextEmbeds(hit)
        for cap in missing:
            # One caption at a time: batched kernels can differ in the last bits with the batch
            # size, and an entry's value must depend on its key alone, not on its neighbours.
            one = self.family.encode_text(self.comps, [cap]).to("cpu")
            key, fields = self._key(cap)
            self.store.put(key, one.tensors, {k: str(v) for k, v in fields.items()})
            found[cap] = one
        return TextEmbeds.cat([found[c] for c in captions])

    def fill(self, captions: list[str], progress: Progress = _no_progress) -> None:
        """Encode every distinct caption not yet stored."""
        todo = [c for c in dict.fromkeys(captions) if self._key(c)[0] not in self.store]
        for caption in progress(todo, "caching text embeddings", len(todo)):
            self.get([caption])
