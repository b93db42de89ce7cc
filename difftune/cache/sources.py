"""Latents and text embeddings for a batch, served from a store or computed on a miss.

Batches ask by item and variant (flip, crop box) or by exact caption text, never by step: the
key is derived from content, so the same request always gets the same entry. `fill_*` computes
every entry a run will need up front, with progress, so training never waits on the VAE or the
text encoders when caching is on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from PIL import Image

from difftune.cache.keys import entry_key, latent_fields, text_fields
from difftune.adapters.embeddings import Embeddings
from difftune.cache.store import Store
from difftune.cache.text_images import TextImage
from difftune.data.discover import Item
from difftune.data.images import crop_box, load_pixels
from difftune.data.clip_masks import load_clip_mask, to_latent_frames
from difftune.data.masks import load_mask, to_latent_grid
from difftune.data.video import read_clip
from difftune.families.base import Components, Family, TextEmbeds, pad_cat
from difftune.families.common import text
from difftune.families.common.text import EncodeOptions

Progress = Callable[[Iterable, str, int], Iterable]
Reload = Callable[[], dict[str, torch.nn.Module]]
log = logging.getLogger("difftune")


Share = Callable[[list[Any]], list[Any]]  # a process's part of a list of work items
Images = tuple[TextImage, ...]  # the images an encoder reads with one caption


def _clip_fields(item: Item) -> dict[str, object] | None:
    """A clip's key fields: start frame, frame count, frame rate (None for an image)."""
    clip = item.clip
    return None if clip is None else {"start": clip.start, "frames": clip.frames,
                                      "fps": clip.fps}


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
        self.unreadable: set[Path] = set()  # images that failed mid-run (warned once each)
        # Whether any item has a loss mask (then every sample of the run carries weights).
        self.masked = any(it.masked for it in items)

    def box(self, index: int) -> tuple[int, int, int, int]:
        """The item's cached crop box; a "random" crop is drawn once per item from the run seed."""
        item = self.items[index]
        rng = random.Random(f"{self.seed}:{index}")
        return crop_box(item.size, item.bucket, item.crop, rng)

    def _fields(self, index: int, flip: bool) -> dict[str, object]:
        item = self.items[index]
        return latent_fields(family=self.family.name, fingerprint=self.comps.fingerprint,
                             dtype=self.dtype, image=item.path, bucket=item.bucket,
                             box=self.box(index), flip=flip, mask=item.mask,
                             alpha_mask=item.alpha_mask, clip=_clip_fields(item))

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

    def sample(self, index: int, flip: bool, sample_seed: int | None = None
               ) -> dict[str, torch.Tensor]:
        """The entry of item `index`, horizontally flipped or not: "latent" (C, h, w), (C, f, h,
        w) for a clip, and, for
        a masked item, "mask" (h, w) on the latent grid ((f, h, w) for a clip).

        With `fresh_crops`, a random-crop item gets a crop drawn from `sample_seed` (the
        sampler's per-occurrence seed) and is encoded live, never cached.
        """
        item = self.items[index]
        box = self.crop_for(index, sample_seed)
        if box != self.box(index):
            return self._encode(item, box, flip)
        hit = self.store.get(self._key(index, flip)[0])
        return hit if hit is not None else self._make(index, flip)

    def get(self, index: int, flip: bool, sample_seed: int | None = None) -> torch.Tensor:
        """Latent (C, h, w) of item `index` (see `sample`), in fp32."""
        return self.sample(index, flip, sample_seed)["latent"].float()

    def readable(self, index: int, flip: bool, sample_seed: int | None = None
                 ) -> torch.Tensor | None:
        """`get`, or None when the image can no longer be read (see `readable_sample`)."""
        found = self.readable_sample(index, flip, sample_seed)
        return None if found is None else found["latent"].float()

    def readable_sample(self, index: int, flip: bool, sample_seed: int | None = None
                        ) -> dict[str, torch.Tensor] | None:
        """`sample`, or None when the image can no longer be read (deleted, replaced by a
        damaged file mid-run, with latents not cached): that sample is skipped with one warning
        per file, and training goes on with the rest."""
        try:
            return self.sample(index, flip, sample_seed)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            path = self.items[index].path
            if path not in self.unreadable:
                self.unreadable.add(path)
                log.warning("image %s cannot be read any more (%s: %s); its samples are "
                            "skipped from now on (training goes on)", path,
                            type(err).__name__, err)
            return None

    def _make(self, index: int, flip: bool) -> dict[str, torch.Tensor]:
        """Encode one (item, flip) variant with its cached crop and store it."""
        key, fields = self._key(index, flip)
        entry = self._encode(self.items[index], self.box(index), flip)
        self.store.put(key, entry, {k: str(v) for k, v in fields.items()})
        return entry

    def _encode(self, item: Item, box: tuple[int, int, int, int], flip: bool
                ) -> dict[str, torch.Tensor]:
        """The latent on the CPU in the VAE's dtype (bf16 stays bf16 in the cache), a masked
        item's mask reduced to the latent's grid (fp32), and for an image-to-video family what
        it reads of the first frame ("start", "start_image": `Family.encode_start`)."""
        if item.clip is not None:  # (3, F, H, W) frames, streamed from the video
            clip = read_clip(item.path, item.clip, item.bucket, box, flip)
            entry = {"latent": self.family.encode_clips(self.comps, clip[None])[0].cpu(),
                     **self._start(clip)}
            if item.mask is None:
                return entry
            mask = load_clip_mask(item.mask, item.clip, item.bucket, box, flip)
            return {**entry, "mask": to_latent_frames(mask, entry["latent"].shape[-3:])}
        pixels = load_pixels(item.path, item.bucket, box, flip)
        entry = {"latent": self.family.encode_images(self.comps, pixels[None])[0].cpu(),
                 **self._start(pixels[:, None])}
        if not item.masked:
            return entry
        mask = load_mask(item.path, item.mask, item.size, item.bucket, box, flip)
        return {**entry, "mask": to_latent_grid(mask, entry["latent"].shape[-2:])}

    def _start(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """What an image-to-video family reads of a sample's (3, F, H, W) frames (its first
        frame, prepared as its pipeline prepares a start image: "start", "start_image"); {}
        for other families."""
        if not self.family.start_image:
            return {}
        return {k: v[0].cpu() for k, v in self.family.encode_start(self.comps,
                                                                    frames[None]).items()}

    def wanted(self) -> list[tuple[int, bool]]:
        """Every (item, flip) variant the run can ask for (both flips where flip is on)."""
        return [(i, f) for i, it in enumerate(self.items)
                for f in ((False, True) if it.flip else (False,))]

    def keys(self) -> set[str]:
        """The keys of every entry the run can ask for (what `cache --prune` keeps)."""
        return {self._key(i, f)[0] for i, f in self.wanted()}

    def fill(self, progress: Progress = _no_progress, share: Share = list) -> list[str]:
        """Compute every variant not yet stored (of this process's `share` of them, when
        several processes fill one cache); returns the keys computed."""
        wanted = share(self.wanted())
        missing = self.store.missing([self._key(i, f)[0] for i, f in wanted])
        todo = [(i, f) for i, f in wanted if self._key(i, f)[0] in missing]
        for i, f in progress(todo, "caching latents", len(todo)):
            self._make(i, f)
        return [self._key(i, f)[0] for i, f in todo]


class TextSource:
    """Text-encoder outputs by exact caption text, cached per encoder and combined per batch.

    Each frozen encoder's output for one caption is its own cache entry (keyed by that encoder's
    spec, max length, mask and clip skip), so training one encoder never invalidates another's
    entries. Encoders in `trained` are never cached: they run live on every call, with
    gradients when the caller's grad mode is on. An encoder whose spec reads images gets each
    caption's images (`images`, parallel to the captions; none when not given), and their
    content keys enter its entries' keys; other encoders ignore them.
    """

    def __init__(self, family: Family, comps: Components, store: Store,
                 options: EncodeOptions | None = None, trained: Iterable[str] = (),
                 reload: Reload | None = None, embeddings: Embeddings | None = None) -> None:
        """`reload` brings back the text encoders after `unload` (see `resident`);
        `embeddings` are learned placeholders: captions using one run live in its encoders."""
        self.family, self.comps, self.store = family, comps, store
        self.embeddings = embeddings
        self.options = options or EncodeOptions()
        self.trained = frozenset(trained)
        self.specs = {s.name: s for s in family.text_encoders}
        self._keys: dict[tuple[str, str, Images], tuple[str, dict[str, object]]] = {}
        # Kept apart from the modules, which may be unloaded: part of every key.
        self._dtypes = {n: str(m.dtype).removeprefix("torch.")
                        for n, m in comps.text_encoders.items()}
        self.reload, self.unloaded = reload, False

    def unload(self) -> list[str]:
        """Drop the frozen encoders from memory (they are reloaded on demand); returns names."""
        assert self.reload is not None, "unloading needs a way to reload"
        names = self._frozen()
        for name in names:
            self.comps.text_encoders[name] = None  # type: ignore[assignment]
        self.unloaded = True
        return names

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The frozen encoders are in memory inside this block: reloaded from their files (in
        the configured dtype) if they were unloaded, and unloaded again afterwards."""
        if not self.unloaded or self.comps.text_encoders[self._frozen()[0]] is not None:
            yield
            return
        assert self.reload is not None
        log.info("reloading text encoders %s to encode new text", ", ".join(self._frozen()))
        loaded = self.reload()
        for name in self._frozen():
            self.comps.text_encoders[name] = loaded[name]
        try:
            yield
        finally:
            for name in self._frozen():
                self.comps.text_encoders[name] = None  # type: ignore[assignment]
            del loaded
            gc.collect()

    def _frozen(self) -> list[str]:
        return [n for n in self.specs if n not in self.trained]

    def encoder_fields(self, name: str) -> dict[str, object]:
        """What decides one encoder's output besides the caption (its cache-key fields)."""
        spec = self.specs[name]
        return dict(spec.key_fields(), max_length=text.max_length(spec, self.comps.extras),
                    mask=self.options.mask_for(spec), clip_skip=self.options.skip_for(spec))

    def _images(self, name: str, images: Images) -> Images:
        """The images encoder `name` reads (none unless its spec reads images)."""
        return images if self.specs[name].reads_images else ()

    def _key(self, name: str, caption: str, images: Images = ()
             ) -> tuple[str, dict[str, object]]:
        images = self._images(name, images)
        if (name, caption, images) not in self._keys:
            dtype = self._dtypes[name]
            fields = text_fields(family=self.family.name, fingerprint=self.comps.fingerprint,
                                 dtype=dtype, caption=caption,
                                 encoders=[self.encoder_fields(name)],
                                 images=[i.key for i in images])
            self._keys[name, caption, images] = entry_key(fields), fields
        return self._keys[name, caption, images]

    def _run(self, name: str, captions: list[str], images: list[Images] | None = None
             ) -> dict[str, torch.Tensor]:
        """One encoder on a batch of captions, in the caller's grad mode (placeholders
        expanded to their tokens, and output embeddings put in, for the encoders that learn)."""
        spec, emb = self.specs[name], self.embeddings
        tok = self.comps.tokenizers[name]
        if spec.reads_images:
            pics = [[i.load() for i in imgs] for imgs in (images or [()] * len(captions))]
            return text.encode_with_images(spec, self.comps.text_encoders[name], tok,
                                           captions, pics)
        if emb is not None:
            captions = [emb.expand(name, c) for c in captions]
        length = text.max_length(spec, self.comps.extras)
        out = text.encode(spec, self.comps.text_encoders[name], tok, captions, length,
                          self.options.mask_for(spec), self.options.skip_for(spec))
        if emb is not None and name in emb.encoders():
            out = emb.replace_outputs(name, text.tokenize(tok, captions, length)["input_ids"], out)
        return out

    def _cacheable(self, name: str, caption: str) -> bool:
        return name not in self.trained and not self._uses(name, [caption])

    def cached(self, name: str, captions: list[str]) -> dict[str, torch.Tensor]:
        """A frozen encoder's outputs (CPU tensors) for a batch, encoding only the misses."""
        return self._frozen_outputs([name], captions)[name]

    def _frozen_outputs(self, names: list[str], captions: list[str],
                        images: list[Images] | None = None
                        ) -> dict[str, dict[str, torch.Tensor]]:
        """Frozen encoders' outputs by name; every miss is encoded in one `resident` block."""
        requests = list(zip(captions, images or [()] * len(captions)))
        found: dict[tuple[str, str, Images], dict[str, torch.Tensor]] = {}
        misses = []
        for name in names:
            for cap, imgs in dict.fromkeys(requests):
                hit = self.store.get(self._key(name, cap, imgs)[0])
                if hit is None:
                    misses.append((name, cap, imgs))
                else:
                    found[name, cap, imgs] = hit
        if misses:
            with self.resident():
                found.update({m: self._make(*m) for m in misses})
        return {n: pad_cat([found[n, c, i] for c, i in requests]) for n in names}

    def _make(self, name: str, caption: str, images: Images = ()) -> dict[str, torch.Tensor]:
        """Encode one caption (with its images) with one frozen encoder and store it.

        One caption at a time: batched kernels can differ in the last bits with the batch
        size, and an entry's value must depend on its key alone.
        """
        key, fields = self._key(name, caption, images)
        with torch.no_grad():
            out = {k: v.cpu() for k, v in
                   self._run(name, [caption], [self._images(name, images)]).items()}
        self.store.put(key, out, {k: str(v) for k, v in fields.items()})
        return out

    def outputs(self, captions: list[str], images: list[Images] | None = None
                ) -> dict[str, dict[str, torch.Tensor]]:
        """Every encoder's outputs: trained ones live (on their device), frozen ones cached;
        `images`: each caption's images, for the encoders that read them."""
        out = {name: self._run(name, captions, images) for name in self.specs
               if name in self.trained}
        device = next((t.device for o in out.values() for t in o.values()), torch.device("cpu"))
        plain = [n for n in self._frozen() if not self._uses(n, captions)]
        frozen = self._frozen_outputs(plain, captions, images)
        out.update({n: {k: v.to(device) for k, v in o.items()} for n, o in frozen.items()})
        for name in self._frozen():
            if name not in plain:
                out[name] = self._mixed(name, captions, device)
        return {name: out[name] for name in self.specs}

    def _uses(self, name: str, captions: list[str]) -> bool:
        return self.embeddings is not None and self.embeddings.uses(name, captions)

    def _mixed(self, name: str, captions: list[str], device: torch.device
               ) -> dict[str, torch.Tensor]:
        """Captions using a placeholder this encoder learns run live (with gradients), the
        others come from the cache; rows are put back in the batch's order."""
        live = [i for i, c in enumerate(captions) if self._uses(name, [c])]
        rest = [i for i in range(len(captions)) if i not in live]
        parts = {tuple(live): self._run(name, [captions[i] for i in live])}
        if rest:
            parts[tuple(rest)] = self._frozen_outputs([name], [captions[i] for i in rest])[name]
        order = [i for idx in parts for i in idx]
        back = torch.tensor([order.index(i) for i in range(len(captions))])
        joined = pad_cat([{k: v.to(device) for k, v in p.items()} for p in parts.values()])
        return {k: v[back.to(device)] for k, v in joined.items()}

    def get(self, captions: list[str], images: list[Images] | None = None) -> TextEmbeds:
        """Embeddings for a batch of captions (with each one's images, for the encoders that
        read them), combined by the family."""
        return self.family.combine_text(self.comps, self.outputs(captions, images))

    def keys(self, captions: list[str], images: list[Images] | None = None) -> set[str]:
        """The entry keys of these captions for every frozen encoder (what `--prune` keeps)."""
        requests = dict.fromkeys(zip(captions, images or [()] * len(captions)))
        return {self._key(n, c, i)[0] for c, i in requests for n in self.specs
                if self._cacheable(n, c)}

    def fill(self, captions: list[str], progress: Progress = _no_progress,
             share: Share = list, images: list[Images] | None = None) -> list[str]:
        """Encode every distinct caption (with its images) not yet stored, for every frozen
        encoder (of this process's `share` of them); returns the keys computed."""
        frozen = self._frozen()
        distinct = share(list(dict.fromkeys(zip(captions, images or [()] * len(captions)))))
        missing = self.store.missing([self._key(n, c, i)[0] for c, i in distinct
                                      for n in frozen])
        todo: dict[tuple[str, Images], list[str]] = {}
        for caption, imgs in distinct:
            names = [n for n in frozen if self._key(n, caption, imgs)[0] in missing
                     and self._cacheable(n, caption)]
            if names:
                todo[caption, imgs] = names
        if not todo:
            return []
        with self.resident():
            for caption, imgs in progress(todo, "caching text embeddings", len(todo)):
                for name in todo[caption, imgs]:
                    self._make(name, caption, imgs)
        return [self._key(n, c, i)[0] for (c, i), names in todo.items() for n in names]
