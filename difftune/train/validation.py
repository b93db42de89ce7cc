"""The validation loss: the held-out set (`DataSet.held`) at fixed timesteps and fixed noise.

Every held-out image is noised at the same `validation.timesteps` times with the same noise
(drawn from its own generator, seeded by `validation.seed` and the image's path) at every
evaluation, through the training objective's `draw_at` (its noising, target and weighting) and
the training loss (`losses.elementwise` / `per_sample`, so the loss options and any mask apply).
Nothing here draws from the run's generator or the global RNGs: a run with validation trains
bit for bit like one without. What the loss decides (keep the best, early stop) is counted in
`TrainState.validation`, so a resumed run decides like an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from difftune.cache.sources import LatentSource
from difftune.data import masks
from difftune.data.discover import Item
from difftune.families.base import Conditioning
from difftune.train import losses
from difftune.train.setup import Run

log = logging.getLogger("difftune")


@dataclass
class Evaluation:
    """One evaluation: the mean loss, the mean at each fixed timestep, and its duration."""

    loss: float
    by_t: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        """The metrics.jsonl entries of this evaluation."""
        return {"val_loss": self.loss, "val_loss_by_t": dict(self.by_t)}


def _label(t: float) -> str:
    """A timestep as a short stable key ("0.125", "500")."""
    return f"{t:g}"


class Validator:
    """Evaluates a run's held-out set; `None` from `of` when the run has none."""

    def __init__(self, run: Run, items: list[Item]) -> None:
        cfg = run.cfg
        self.run, self.items, self.cfg = run, items, cfg.validation
        # Held-out latents share the training store (their keys name their own images).
        self.latents = LatentSource(run.family, run.comps, items, run.latents.store,
                                    cfg.train.seed)
        self.captions = [it.augment.fixed(it.caption) for it in items]
        self.t = run.objective.fixed_timesteps(self.cfg.timesteps)

    @classmethod
    def of(cls, run: Run) -> "Validator | None":
        """The run's validator, or None without a validation set."""
        return cls(run, run.data.held) if run.data.held else None

    def fill(self, progress: Callable[..., Any] | None = None) -> None:
        """Encode the held-out latents now, while the VAE is loaded (text goes with the
        training captions: `captions`)."""
        if self.run.cfg.cache.latents != "none":
            self.latents.fill(progress) if progress else self.latents.fill()

    def due(self, step: int) -> bool:
        """Evaluated after every `every_n_steps` steps and after the last one."""
        return step % self.cfg.every_n_steps == 0 or step == self.run.cfg.train.steps

    def noise(self, index: int, shape: torch.Size) -> torch.Tensor:
        """The fixed noise of held-out image `index` (one per timestep), from its own
        generator: `validation.seed` and the image's path."""
        key = hashlib.sha256(f"{self.cfg.seed}:{self.items[index].path}".encode()).digest()
        gen = torch.Generator("cpu").manual_seed(int.from_bytes(key[:7], "little"))
        return torch.randn((len(self.t), *shape), generator=gen)

    def _conditioning(self, index: int, n: int) -> Conditioning:
        """The image's sizes and crop, repeated for its n timesteps."""
        it, box = self.items[index], self.latents.box(index)
        return Conditioning(guidance=self.run.cfg.train.guidance,
                            original_sizes=[(it.size[1], it.size[0])] * n,
                            crops=[(box[1], box[0])] * n,
                            target_sizes=[(it.bucket[1], it.bucket[0])] * n)

    def _image_losses(self, index: int) -> torch.Tensor:
        """Per-timestep (weighted) losses of one held-out image."""
        run, device, n = self.run, self.run.policy.device, len(self.t)
        entry = self.latents.sample(index, False)
        latent = entry["latent"].float()
        x0 = latent[None].expand(n, *latent.shape).to(device)
        draw = run.objective.draw_at(x0, self.noise(index, latent.shape), self.t)
        embeds = run.texts.get([self.captions[index]] * n).to(device)
        with run.policy.autocast():
            cond = replace(self._conditioning(index, n), **{  # image-to-video: its own start
                f: v[None].expand(n, *v.shape).to(device) for f, v in entry.items()
                if f.startswith("start")})
            pred = run.family.predict(run.comps, draw.noisy, embeds, draw.t, cond)
        err = losses.elementwise(pred, draw.target,
                                 *losses.options(run.cfg.train, run.objective, draw.t))
        mask = (masks.batch_weights([entry] * n, [self.items[index].unmasked_weight] * n)
                if "mask" in entry else None)
        per = losses.per_sample(err, mask)
        if draw.weights is not None:
            per = per * draw.weights.to(per.device, torch.float32)
        return per.detach().cpu()

    def evaluate(self) -> Evaluation:
        """The validation loss of the weights in the model now (the caller puts the saved
        weights in and the modules in eval mode)."""
        started = time.perf_counter()
        with torch.no_grad():
            table = torch.stack([self._image_losses(i) for i in range(len(self.items))])
        by_t = table.mean(dim=0)
        labels = [_label(float(t)) for t in self.t]
        return Evaluation(float(table.mean()), dict(zip(labels, map(float, by_t))),
                          time.perf_counter() - started)

    def judge(self, progress: dict[str, Any], step: int, loss: float) -> bool:
        """Record `loss` in `progress` (TrainState.validation: best, best_step, bad); returns
        whether it improved on the best by more than `min_delta`."""
        best = progress.get("best")
        better = math.isfinite(loss) and (best is None or loss < best - self.cfg.min_delta)
        if better:
            progress.update(best=loss, best_step=step, bad=0)
        else:
            progress["bad"] = int(progress.get("bad", 0)) + 1
        return better

    def should_stop(self, progress: dict[str, Any]) -> bool:
        """Whether early stopping ends the run now (patience evaluations without improving)."""
        patience = self.cfg.early_stop_patience
        return patience is not None and int(progress.get("bad", 0)) >= patience

    def best_path(self, out: Path) -> Path:
        """`<save.name>-best.safetensors` in the output folder."""
        return out / f"{self.run.cfg.save.name}-best.safetensors"


def describe(run: Run) -> list[str]:
    """`check`'s lines: the validation set's size and the rule that turned it on (or why
    it is off), and the time one evaluation takes (measured: one evaluation is run)."""
    from difftune.data import holdout

    v, held = run.cfg.validation, run.data.held
    images = len(run.data.items) + (0 if v.path is not None else len(held))
    why = holdout.rule(run.cfg, images)
    if not holdout.enabled(run.cfg, images):
        return [f"validation: off ({why})"]
    if not held:
        return [f"validation: on ({why}) but no image could be held out (each dataset needs "
                "2 ordinary images); set validation.path to a folder of its own"]
    source = f"{v.path}" if v.path is not None else f"{v.fraction:g} of each dataset held out"
    validator = Validator(run, held)
    for module in (run.comps.denoiser, *run.trained_encoders.values()):
        module.train(False)
    ev = validator.evaluate()
    return [f"validation: on ({why}): {len(held)} images ({source}), every "
            f"{v.every_n_steps} steps at {v.timesteps} timesteps; one evaluation takes "
            f"{ev.seconds:.2f} s (loss now {ev.loss:.4f})"]
