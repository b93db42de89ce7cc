"""The training step's forward half: one batch -> its loss.

Looks the batch's latents and texts up in the caches (by item and variant, never by step),
draws noise and timesteps from the run's generator, builds the family's conditioning and asks
the objective for the loss. The loop runs backward and the optimizer; `setup.py` prepares what
this reads (model, data, caches).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from difftune.families.base import Conditioning
from difftune.train import losses
from difftune.train.objectives import Draw
from difftune.train.setup import Run


def batch_loss(run: Run, indices: list[int], flips: list[bool], generator: torch.Generator,
               seeds: list[int | None] | None = None, step: int = 0,
               rows: tuple[slice, int] | None = None) -> torch.Tensor | None:
    """The training loss of one batch (forward only; the caller runs backward), or None when
    none of its images can be read any more (see `LatentSource.readable`).

    `flips` and `seeds` are the sampler's per-occurrence augmentation decisions; `step` the
    optimizer step (token warm-up). Latents and texts are looked up by item and variant.
    `rows` = (these rows, global size) when the batch is one process's share of a global
    batch: noise and timesteps are drawn for the global batch and these rows kept.
    """
    device = run.policy.device
    per_sample = seeds if seeds is not None else [None] * len(indices)
    found = [run.latents.readable(i, f, s) for i, f, s in zip(indices, flips, per_sample)]
    # An edit pair whose control image can no longer be read is skipped like its target.
    controls = [run.controls.readable(i) for i in indices]
    found = [x if c is not None else None for x, c in zip(found, controls)]
    keep = [k for k, latent in enumerate(found) if latent is not None]
    if not keep:
        return None
    like = found[keep[0]]
    latents = torch.stack([x if x is not None else torch.zeros_like(like) for x in found])
    # Drawn for every row, read or not, so the noise of later steps stays the same.
    draw = _draw(run, latents.to(device), generator, rows)
    if len(keep) < len(found):
        draw = draw.rows(torch.tensor(keep))
        indices, per_sample = [indices[k] for k in keep], [per_sample[k] for k in keep]
    captions = [run.captions.text(i, s, step) for i, s in zip(indices, per_sample)]
    images = [run.controls.text_images(i) for i in indices]  # () unless the encoder reads them
    embeds = run.texts.get(captions, images).to(device)
    cond = conditioning(run, indices, per_sample)
    kept = [controls[k] for k in keep]
    if kept[0]:  # one (B, C, h, w) tensor per control image: the sampler never mixes sizes
        cond = replace(cond, controls=tuple(torch.stack([c[n] for c in kept]).to(device)
                                            for n in range(len(kept[0]))))
    with run.policy.autocast():
        pred = run.family.predict(run.comps, draw.noisy, embeds, draw.t, cond)
    err = losses.elementwise(pred, draw.target, *losses.options(run.cfg.train, run.objective,
                                                                draw.t))
    return losses.batch_mean(losses.per_sample(err), draw.weights)


def _draw(run: Run, latents: torch.Tensor, generator: torch.Generator,
          rows: tuple[slice, int] | None) -> Draw:
    """The objective's draw for `latents`, or for the global batch they are `rows` of."""
    if rows is None:
        return run.objective.draw(latents, generator)
    where, n = rows
    full = latents.new_zeros((n, *latents.shape[1:]))
    full[where] = latents
    return run.objective.draw(full, generator).rows(where)


def conditioning(run: Run, indices: list[int], seeds: list[int | None]) -> Conditioning:
    """Guidance and per-sample sizes and crops ((height, width), (top, left)) of a batch."""
    items = [run.data.items[i] for i in indices]
    boxes = [run.latents.crop_for(i, s) for i, s in zip(indices, seeds)]
    return Conditioning(
        guidance=run.cfg.train.guidance,
        original_sizes=[(it.size[1], it.size[0]) for it in items],
        crops=[(box[1], box[0]) for box in boxes],
        target_sizes=[(it.bucket[1], it.bucket[0]) for it in items],
    )
