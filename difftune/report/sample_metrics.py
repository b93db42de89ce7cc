"""Sample-quality metrics of one sample event, against the run's training images.

- fidelity: the mean cosine similarity (DINOv2 features) of a sample to every training image;
  per prompt (mean of its samples) and overall (mean of all samples).
- clip_score: CLIPScore of each sample against its prompt; per prompt and overall.
- memorization: each sample's nearest training image and that similarity. A sample is flagged
  as a copy when it is at least as similar to that image's VAE copy (the decode of its own
  latent, the closest any sample can come; report/vae_copies.py) as the VAE copy's own degraded
  copies are (`copy_floors`: JPEG at quality 50, Gaussian noise, resampling at half size),
  measured with the same feature model: a copy of T is, to the features, T after some loss. The
  floor is per image and needs no other training image, so it holds for a run of one subject,
  of six unrelated ones (each learned from its one image) or of one image alike; docs/
  training-signal.md has the figures that retired the earlier references (the closest pair of
  distinct training images fired before training on the demo; the images themselves are out
  of reach of a tiny model's VAE). `metrics.copy_similarity`, where set, replaces every floor.
- diversity: the mean pairwise similarity among one prompt's samples (the same prompt at
  several seeds); overall the mean over such prompts. Collapse shows as it rises.

Training-image features are computed once and cached on disk under `cache.dir/features`, keyed
by the DINOv2 folder's content and the image's bytes (like every other cache entry).
"""

from __future__ import annotations

import io
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from difftune.cache.disk import DiskStore
from difftune.cache.keys import entry_key, file_hash
from difftune.report.scoring import Scorers, read_image

log = logging.getLogger("difftune")

BATCH = 16  # images per forward of a metric model
PROMPT_KEY, SEED_KEY = "difftune.prompt", "difftune.seed"  # PNG text chunks of a sample


# What a copy survives and stays a copy (each applied alone to the training image): lossy
# compression, sensor-like noise and resampling, at strengths a person still calls the same
# picture; a sample as similar to T as the least similar of these is taken for a copy of T.
JPEG_QUALITY = 50
NOISE_STD = 16.0  # of 255
NOISE_SEED = 0


@dataclass
class Reference:
    """The training images' features and, per image, what a copy is compared with (its VAE
    copy's features) and the similarity a copy reaches."""

    names: list[str]
    features: torch.Tensor  # M x D, unit length (fidelity)
    floors: torch.Tensor  # M: the least similarity of each copy target's degraded copies to it
    copies: torch.Tensor  # M x D: the features a sample's likeness to a copy is measured on


@dataclass
class Sample:
    """One saved sample and the prompt it was made from."""

    path: Path
    prompt: str
    seed: int | None = None


def read_sample(path: Path) -> Sample:
    """A sample PNG with the prompt the runner wrote into it (a file without one: its name)."""
    with Image.open(path) as im:
        text = dict(getattr(im, "text", {}) or {})
    seed = text.get(SEED_KEY)
    return Sample(path, text.get(PROMPT_KEY, path.stem),
                  int(seed) if seed and seed.lstrip("-").isdigit() else None)


def _batched_features(scorers: Scorers, paths: list[Path]) -> torch.Tensor:
    chunks = [scorers.features([read_image(p) for p in paths[i:i + BATCH]])
              for i in range(0, len(paths), BATCH)]
    return torch.cat(chunks) if chunks else torch.zeros(0, 0)


def degraded(image: Image.Image) -> list[Image.Image]:
    """Copies of `image` a person still calls the same picture: JPEG at quality 50, Gaussian
    noise (std 16 of 255, fixed seed), and resampled to half size and back."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    jpeg = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    pixels = np.asarray(image, dtype=np.float32)
    noise = np.random.default_rng(NOISE_SEED).normal(0.0, NOISE_STD, pixels.shape)
    noisy = Image.fromarray(np.clip(pixels + noise, 0, 255).round().astype(np.uint8))
    half = (max(1, image.width // 2), max(1, image.height // 2))
    resampled = image.resize(half, Image.BICUBIC).resize(image.size, Image.BICUBIC)
    return [jpeg, noisy, resampled]


def _floors(scorers: Scorers, paths: list[Path]) -> torch.Tensor:
    """Each image's copy floor: the least similarity of its degraded copies to it (M x 1)."""
    out = []
    for path in paths:
        image = read_image(path)
        feats = scorers.features([image, *degraded(image)])
        out.append((feats[1:] @ feats[0]).min().reshape(1))
    return torch.stack(out) if out else torch.zeros(0, 1)


def _cached(scorers: Scorers, paths: list[Path], cache_dir: Path, kind: str, name: str,
            compute: Callable[[list[Path]], torch.Tensor]) -> torch.Tensor:
    """A per-image tensor (`name` in a cache entry of `kind`) for `paths`, each read from the
    cache when its entry exists (keyed by the DINOv2 folder's content and the image's bytes),
    else computed and stored."""
    store = DiskStore(cache_dir, "features")
    keys = [entry_key({"kind": kind, "model": scorers.fingerprint,
                       "image_sha256": file_hash(p)}) for p in paths]
    found = {k: e[name] for k in dict.fromkeys(keys) if (e := store.get(k)) is not None}
    todo = [(k, p) for k, p in dict(zip(keys, paths)).items() if k not in found]
    if todo:
        fresh = compute([p for _, p in todo])
        for (key, path), value in zip(todo, fresh):
            store.write(key, {name: value.contiguous()}, {"image": path.name})
            found[key] = value
    return torch.stack([found[k] for k in keys])


def training_features(scorers: Scorers, paths: list[Path], cache_dir: Path) -> torch.Tensor:
    """The features of `paths` (M x D), cached by content."""
    return _cached(scorers, paths, cache_dir, "dino_features", "features",
                   lambda todo: _batched_features(scorers, todo))


def reference(scorers: Scorers, paths: list[Path], cache_dir: Path,
              copy_similarity: float | None = None,
              copies: list[Path] | None = None) -> Reference:
    """The training images' features, and the copy targets' (`copies`, each training image's
    VAE copy (report/vae_copies.py); the images themselves where None) features and floors,
    all cached by content; a set `copy_similarity` is every image's floor instead."""
    feats = training_features(scorers, paths, cache_dir)
    targets = paths if copies is None else copies
    near = feats if copies is None else training_features(scorers, targets, cache_dir)
    if copy_similarity is not None:
        floors = torch.full((len(paths),), float(copy_similarity))
    else:
        floors = _cached(scorers, targets, cache_dir, "dino_copy_floor", "floor",
                         lambda todo: _floors(scorers, todo)).reshape(-1)
    return Reference([p.name for p in paths], feats, floors, near)


def floors_line(ref: Reference) -> str:
    """The copy floors in words (the run log's and `check`'s line)."""
    if not len(ref.floors):
        return "no copy floors (no training images)"
    low, high = float(ref.floors.min()), float(ref.floors.max())
    return (f"copy floor {low:.4f}" if high - low < 5e-5 else
            f"copy floors {low:.4f}-{high:.4f}") + " (a sample this similar is a copy)"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _diversity(feats: torch.Tensor) -> float | None:
    """Mean cosine similarity over the pairs of rows (None for fewer than two)."""
    pairs = list(itertools.combinations(range(len(feats)), 2))
    return _mean([float(feats[i] @ feats[j]) for i, j in pairs])


def measure(scorers: Scorers, ref: Reference, samples: list[Sample]) -> dict[str, Any]:
    """The metrics of one event's samples: overall figures at the top level (what keep_best
    and charts read), per prompt under `prompts`, per sample under `samples`."""
    feats = _batched_features(scorers, [s.path for s in samples])
    sims = feats @ ref.features.T  # N x M: fidelity
    likeness = feats @ ref.copies.T  # N x M: to each image's copy target (memorization)
    clip = [scorers.clip_scores([read_image(s.path) for s in samples[i:i + BATCH]],
                                [s.prompt for s in samples[i:i + BATCH]])
            for i in range(0, len(samples), BATCH)]
    clip_t = None if scorers.clip is None else torch.cat([c for c in clip if c is not None])
    rows = []
    for i, s in enumerate(samples):
        near = int(likeness[i].argmax())
        rows.append({"file": s.path.name, "prompt": s.prompt, "fidelity": float(sims[i].mean()),
                     "nearest": ref.names[near], "nearest_similarity": float(likeness[i, near]),
                     "copy_floor": float(ref.floors[near]),
                     **({"clip_score": float(clip_t[i])} if clip_t is not None else {})})
    prompts = {}
    for prompt in dict.fromkeys(s.prompt for s in samples):
        idx = [i for i, s in enumerate(samples) if s.prompt == prompt]
        prompts[prompt] = _summary([rows[i] for i in idx], _diversity(feats[idx]))
    diversity = _mean([p["diversity"] for p in prompts.values() if "diversity" in p])
    top = _summary(rows, diversity)
    closest = max(rows, key=_copy_margin)
    top.update(nearest_similarity=max(r["nearest_similarity"] for r in rows),
               copy_reference=closest["copy_floor"], copying=_copy_margin(closest) >= 0)
    return {**top, "prompts": prompts, "samples": rows}


def _summary(rows: list[dict[str, Any]], diversity: float | None) -> dict[str, Any]:
    """Means of the per-sample figures (and the diversity where there is one)."""
    out: dict[str, Any] = {"fidelity": _mean([r["fidelity"] for r in rows])}
    if rows and "clip_score" in rows[0]:
        out["clip_score"] = _mean([r["clip_score"] for r in rows])
    if diversity is not None:
        out["diversity"] = diversity
    return out


def _copy_margin(row: dict[str, Any]) -> float:
    """How far a sample is past its nearest image's copy floor (>= 0: a copy)."""
    return row["nearest_similarity"] - row["copy_floor"]


def copy_warning(step: int, m: dict[str, Any]) -> str | None:
    """The memorization warning of an event's metrics, or None when nothing is copied."""
    if not m.get("copying"):
        return None
    worst = max(m["samples"], key=_copy_margin)
    return (f"samples at step {step} look copied from the training data: {worst['file']} has "
            f"similarity {worst['nearest_similarity']:.4f} to {worst['nearest']} (as the "
            "model's VAE reproduces it, where the run made VAE copies), as close as a JPEG, "
            f"noised or resampled copy of it ({worst['copy_floor']:.4f}); earlier "
            "checkpoints may generalize better (lower lr or fewer steps)")
