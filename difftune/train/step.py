"""The training step's forward half: one batch -> its loss.

Looks the batch's latents and texts up in the caches (by item and variant, never by step),
draws noise and timesteps from the run's generator, builds the family's conditioning and asks
the objective for the loss. The loop runs backward and the optimizer; `setup.py` prepares what
this reads (model, data, caches).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from difftune.data import masks as loss_masks
from difftune.families.base import Conditioning
from difftune.train import losses, preservation
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
    per_sample = seeds if seeds is not None else [None] * len(indices)
    entries = [run.latents.readable_sample(i, f, s)
               for i, f, s in zip(indices, flips, per_sample)]
    found = [e["latent"].float() if e is not None else None for e in entries]
    # An edit pair whose control image can no longer be read is skipped like its target.
    controls = [run.controls.readable(i) for i in indices]
    found = [x if c is not None else None for x, c in zip(found, controls)]
    keep = [k for k, latent in enumerate(found) if latent is not None]
    if not keep:
        return None
    like = found[keep[0]]
    latents = torch.stack([x if x is not None else torch.zeros_like(like) for x in found])
    # Drawn for every row, read or not, so the noise of later steps stays the same.
    draw = _draw(run, latents.to(run.policy.device), generator, rows)
    if len(keep) < len(found):
        draw = draw.rows(torch.tensor(keep))
        indices, per_sample = [indices[k] for k in keep], [per_sample[k] for k in keep]
    captions = [run.captions.text(i, s, step) for i, s in zip(indices, per_sample)]
    kept = [controls[k] for k in keep]
    # an image-to-video sample's start-frame entries ("start", "start_image"), by field
    starts = [{f: v for f, v in entries[k].items() if f.startswith("start")} for k in keep]
    # Output preservation: the trigger-free twins ride in the same forward, on the same draw.
    twins = preservation.rows(captions, run.cfg.preservation)
    at = [r for r, _ in twins]
    rows_of = (lambda xs: [xs[r] for r in at])  # noqa: E731
    n = len(indices)
    noisy, t = ((torch.cat([draw.noisy, draw.noisy[at]]), torch.cat([draw.t, draw.t[at]]))
                if at else (draw.noisy, draw.t))
    pred = predict(run, indices + rows_of(indices), per_sample + rows_of(per_sample),
                    captions + [c for _, c in twins], kept + rows_of(kept), noisy, t,
                    starts + rows_of(starts))
    mask = _masks(run, [entries[k] for k in keep], indices)
    err = losses.elementwise(pred[:n], draw.target,
                             *losses.options(run.cfg.train, run.objective, draw.t))
    loss = losses.batch_mean(losses.per_sample(err, mask),
                             subset_weights(run, indices, draw.weights))
    if twins:
        loss = loss + _preservation_loss(run, pred[n:], rows_of(indices), rows_of(per_sample),
                                         [c for _, c in twins], rows_of(kept),
                                         draw.noisy[at], draw.t[at], rows_of(starts))
    return loss


def _masks(run: Run, entries: list[dict[str, torch.Tensor]], indices: list[int]
           ) -> torch.Tensor | None:
    """The batch's (B, h, w) loss weights, or None in a run without masks (its loss then is
    computed exactly as without the feature)."""
    if not run.latents.masked:
        return None
    floors = [run.data.items[i].unmasked_weight for i in indices]
    return loss_masks.batch_weights(entries, floors)


def predict(run: Run, indices: list[int], seeds: list[int | None], captions: list[str],
            controls: list, noisy: torch.Tensor, t: torch.Tensor,
            starts: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
    """The denoiser's prediction for these rows: their captions' embeddings, sizes, crops,
    control latents (`controls[j]`: row j's, as `ControlSource.readable` gave them) and, for
    an image-to-video family, what it reads of the start frame (`starts[j]`: row j's cache
    entries by `Conditioning` field)."""
    device = run.policy.device
    images = [run.controls.text_images(i) for i in indices]  # () unless the encoder reads them
    embeds = run.texts.get(captions, images).to(device)
    cond = conditioning(run, indices, seeds)
    if controls[0]:  # one (B, C, h, w) tensor per control image: the sampler never mixes sizes
        cond = replace(cond, controls=tuple(torch.stack([c[k] for c in controls]).to(device)
                                            for k in range(len(controls[0]))))
    if starts and starts[0]:
        cond = replace(cond, **{f: torch.stack([s[f] for s in starts]).to(device)
                                for f in starts[0]})
    with run.policy.autocast():
        return run.family.predict(run.comps, noisy, embeds, t, cond)


def _preservation_loss(run: Run, pred: torch.Tensor, indices: list[int],
                       seeds: list[int | None], captions: list[str], controls: list,
                       noisy: torch.Tensor, t: torch.Tensor,
                       starts: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """`preservation.weight` times the error of the adapter's predictions `pred` on the
    trigger-free captions against the base model's (adapters off, no gradient), on the same
    noisy latents and timesteps; the unweighted error is recorded for metrics.jsonl."""
    with torch.no_grad(), preservation.adapters_off([run.comps.denoiser,
                                                     *run.trained_encoders.values()]):
        base = predict(run, indices, seeds, captions, controls, noisy, t, starts)
    term = losses.batch_mean(losses.per_sample(losses.elementwise(pred, base)))
    preservation.accumulate(run.extras, term)
    return term * run.cfg.preservation.weight


def subset_weights(run: Run, indices: list[int],
                   weights: torch.Tensor | None) -> torch.Tensor | None:
    """Per-sample loss weights: each sample's subset `loss_weight` times the objective's own
    (None when both are all ones / absent, so the common case adds no kernel)."""
    mine = [run.data.items[i].loss_weight for i in indices]
    if all(w == 1.0 for w in mine):
        return weights
    out = torch.tensor(mine, dtype=torch.float32)
    return out if weights is None else out.to(weights.device) * weights.float()


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
