"""Latents of edit pairs' control images, served from the latent store or computed on a miss.

A control image is encoded whole (never cropped or mirrored) at the size the family's rule
gave it when the data was scanned (`Item.control_sizes`), through the same VAE path as the
targets (`Family.encode_images`). Entries are content-addressed like target latents (image
bytes, size, the family's size rule, model and dtype: `cache.keys.control_fields`), so they
share the latent store (memory or disk) without ever colliding with a target's entry.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from difftune.cache.keys import control_fields, entry_key
from difftune.cache.sources import Progress, Share, _no_progress
from difftune.cache.store import Store
from difftune.cache.text_images import TextImage, from_file
from difftune.data.discover import Item
from difftune.data.images import probe_image
from difftune.families.base import Components, Family

log = logging.getLogger("difftune")


class ControlSource:
    """Control-image latents of dataset items, by (item index, control number)."""

    def __init__(self, family: Family, comps: Components, items: list[Item],
                 store: Store, resolutions: tuple[int, ...] = ()) -> None:
        """`store` is the run's latent store (keys of another kind: no collision);
        `resolutions` the datasets' resolutions, by dataset index (0 where not given)."""
        self.family, self.comps, self.items, self.store = family, comps, items, store
        self.resolutions = resolutions
        self.dtype = str(comps.vae.dtype).removeprefix("torch.")
        self._keys: dict[tuple[int, int], tuple[str, dict[str, Any]]] = {}
        self.unreadable: set[tuple[Path, ...]] = set()  # warned once each
        self.reads_images = any(s.reads_images for s in family.text_encoders)
        self._text_images: dict[int, tuple[TextImage, ...]] = {}

    def _key(self, index: int, n: int) -> tuple[str, dict[str, Any]]:
        """The entry key (and its fields) of item `index`'s control number `n`."""
        if (index, n) not in self._keys:
            item = self.items[index]
            fields = control_fields(self.family.name, self.comps.fingerprint, self.dtype,
                                    item.controls[n], item.control_sizes[n],
                                    self.family.control_key(self._resolution(item)))
            self._keys[index, n] = entry_key(fields), fields
        return self._keys[index, n]

    def _resolution(self, item: Item) -> int:
        """The resolution `item` is bucketed at; for items made without one, its dataset's
        (0 when the caller gave none)."""
        if item.resolution:
            return item.resolution
        return self.resolutions[item.dataset] if item.dataset < len(self.resolutions) else 0

    def get(self, index: int) -> list[torch.Tensor]:
        """Item `index`'s control latents (C, h, w) in float32, one per control image."""
        out = []
        for n in range(len(self.items[index].controls)):
            hit = self.store.get(self._key(index, n)[0])
            out.append((hit["latent"] if hit is not None else self._make(index, n)).float())
        return out

    def readable(self, index: int) -> list[torch.Tensor] | None:
        """`get`, or None when a control image can no longer be read (deleted or damaged
        mid-run, latents not cached): that pair is skipped, with one warning per file."""
        try:
            return self.get(index)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            paths = self.items[index].controls
            if paths not in self.unreadable:
                self.unreadable.add(paths)
                log.warning("control image of %s cannot be read any more (%s: %s); the pair's "
                            "samples are skipped from now on (training goes on)",
                            self.items[index].path, type(err).__name__, err)
            return None

    def text_images(self, index: int) -> tuple[TextImage, ...]:
        """Item `index`'s control images as its text encoder reads them with the caption (at
        the family's `text_image_size`); () when no encoder of the family reads images."""
        if not self.reads_images:
            return ()
        if index not in self._text_images:
            item, rule = self.items[index], self.family.text_image_rule
            self._text_images[index] = tuple(
                from_file(path, self.family.text_image_size(probe_image(path), size), rule)
                for path, size in zip(item.controls, item.control_sizes))
        return self._text_images[index]

    def text_requests(self, known: list[list[str] | None]
                      ) -> tuple[list[str], list[tuple[TextImage, ...]]]:
        """The captions every item may draw (`known`: per item, None when drawn afresh) and,
        parallel to them, the item's text images."""
        pairs = [(t, self.text_images(i)) for i, k in enumerate(known) if k is not None
                 for t in k]
        return [t for t, _ in pairs], [im for _, im in pairs]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        """The batch's control latents: one (B, C, h, w) tensor per control number (the
        sampler never mixes control sizes in a batch); () for items without controls."""
        per_item = [self.get(i) for i in indices]
        if not per_item or not per_item[0]:
            return ()
        return tuple(torch.stack([c[n] for c in per_item]) for n in range(len(per_item[0])))

    def _make(self, index: int, n: int) -> torch.Tensor:
        """Encode one control image at its size and store it (on the CPU, in the VAE dtype)."""
        key, fields = self._key(index, n)
        item = self.items[index]
        pixels = self.family.control_pixels(item.controls[n], item.control_sizes[n],
                                            self._resolution(item))
        latent = self.family.encode_images(self.comps, pixels)[0].cpu()
        self.store.put(key, {"latent": latent}, {k: str(v) for k, v in fields.items()})
        return latent

    def wanted(self) -> list[tuple[int, int]]:
        """Every (item, control number) the run can ask for."""
        return [(i, n) for i, it in enumerate(self.items) for n in range(len(it.controls))]

    def keys(self) -> set[str]:
        """The keys of every control entry the run can ask for (what a prune keeps)."""
        return {self._key(i, n)[0] for i, n in self.wanted()}

    def fill(self, progress: Progress = _no_progress, share: Share = list) -> list[str]:
        """Encode every control image not yet stored (this process's `share`); returns the
        keys computed."""
        wanted = share(self.wanted())
        missing = self.store.missing([self._key(i, n)[0] for i, n in wanted])
        todo = [(i, n) for i, n in wanted if self._key(i, n)[0] in missing]
        for i, n in progress(todo, "caching control latents", len(todo)):
            self._make(i, n)
        return [self._key(i, n)[0] for i, n in todo]
