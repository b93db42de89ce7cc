"""Sample-quality metrics of one sample event, against the run's training images.

- fidelity: the mean cosine similarity (DINOv2 features) of a sample to every training image;
  per prompt (mean of its samples) and overall (mean of all samples).
- clip_score: CLIPScore of each sample against its prompt; per prompt and overall.
- memorization: each sample's nearest training image and that similarity. The event is
  flagged as copying when a sample comes closer to a training image than any two distinct
  training images come to each other (the closest pair's similarity is the reference; with
  fewer than two distinct images, `metrics.copy_similarity`).
- diversity: the mean pairwise similarity among one prompt's samples (the same prompt at
  several seeds); overall the mean over such prompts. Collapse shows as it rises.

Training-image features are computed once and cached on disk under `cache.dir/features`, keyed
by the DINOv2 folder's content and the image's bytes (like every other cache entry).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from difftune.cache.disk import DiskStore
from difftune.cache.keys import entry_key, file_hash
from difftune.report.scoring import Scorers, read_image

log = logging.getLogger("difftune")

BATCH = 16  # images per forward of a metric model
PROMPT_KEY, SEED_KEY = "difftune.prompt", "difftune.seed"  # PNG text chunks of a sample


@dataclass
class Reference:
    """The training images' features and the similarity a copy has to exceed."""

    names: list[str]
    features: torch.Tensor  # M x D, unit length
    copy_reference: float


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


def training_features(scorers: Scorers, paths: list[Path], cache_dir: Path) -> torch.Tensor:
    """The features of `paths` (M x D), each read from the cache when its entry exists, else
    computed and stored."""
    store = DiskStore(cache_dir, "features")
    keys = [entry_key({"kind": "dino_features", "model": scorers.fingerprint,
                       "image_sha256": file_hash(p)}) for p in paths]
    found = {k: e["features"] for k in dict.fromkeys(keys) if (e := store.get(k)) is not None}
    todo = [(k, p) for k, p in dict(zip(keys, paths)).items() if k not in found]
    if todo:
        fresh = _batched_features(scorers, [p for _, p in todo])
        for (key, path), feat in zip(todo, fresh):
            store.write(key, {"features": feat.contiguous()}, {"image": path.name})
            found[key] = feat
    return torch.stack([found[k] for k in keys])


def reference(scorers: Scorers, paths: list[Path], cache_dir: Path,
              copy_similarity: float) -> Reference:
    """The training images' features and the copy threshold (the closest distinct pair)."""
    feats = training_features(scorers, paths, cache_dir)
    distinct = list(dict.fromkeys(file_hash(p) for p in paths))
    first = [[file_hash(p) for p in paths].index(h) for h in distinct]
    if len(first) < 2:
        ref = copy_similarity
    else:
        f = feats[first]
        sims = f @ f.T
        sims.fill_diagonal_(-1.0)
        ref = float(sims.max())
    return Reference([p.name for p in paths], feats, ref)


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
    sims = feats @ ref.features.T  # N x M
    clip = [scorers.clip_scores([read_image(s.path) for s in samples[i:i + BATCH]],
                                [s.prompt for s in samples[i:i + BATCH]])
            for i in range(0, len(samples), BATCH)]
    clip_t = None if scorers.clip is None else torch.cat([c for c in clip if c is not None])
    rows = []
    for i, s in enumerate(samples):
        near = int(sims[i].argmax())
        rows.append({"file": s.path.name, "prompt": s.prompt, "fidelity": float(sims[i].mean()),
                     "nearest": ref.names[near], "nearest_similarity": float(sims[i, near]),
                     **({"clip_score": float(clip_t[i])} if clip_t is not None else {})})
    prompts = {}
    for prompt in dict.fromkeys(s.prompt for s in samples):
        idx = [i for i, s in enumerate(samples) if s.prompt == prompt]
        prompts[prompt] = _summary([rows[i] for i in idx], _diversity(feats[idx]))
    diversity = _mean([p["diversity"] for p in prompts.values() if "diversity" in p])
    top = _summary(rows, diversity)
    nearest = max(rows, key=lambda r: r["nearest_similarity"])
    top.update(nearest_similarity=nearest["nearest_similarity"],
               copy_reference=ref.copy_reference,
               copying=nearest["nearest_similarity"] > ref.copy_reference)
    return {**top, "prompts": prompts, "samples": rows}


def _summary(rows: list[dict[str, Any]], diversity: float | None) -> dict[str, Any]:
    """Means of the per-sample figures (and the diversity where there is one)."""
    out: dict[str, Any] = {"fidelity": _mean([r["fidelity"] for r in rows])}
    if rows and "clip_score" in rows[0]:
        out["clip_score"] = _mean([r["clip_score"] for r in rows])
    if diversity is not None:
        out["diversity"] = diversity
    return out


def copy_warning(step: int, m: dict[str, Any]) -> str | None:
    """The memorization warning of an event's metrics, or None when nothing is copied."""
    if not m.get("copying"):
        return None
    worst = max(m["samples"], key=lambda r: r["nearest_similarity"])
    return (f"samples at step {step} look copied from the training data: {worst['file']} has "
            f"similarity {worst['nearest_similarity']:.4f} to {worst['nearest']}, closer than "
            f"any two training images ({m['copy_reference']:.4f}); earlier checkpoints may "
            "generalize better (lower lr or fewer steps)")
