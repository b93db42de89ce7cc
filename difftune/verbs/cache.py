"""`difftune cache`: fill the latent and text-embedding caches without training (and prune
entries no run would read again)."""

from __future__ import annotations

import logging

from difftune.cache.disk import DiskStore
from difftune.config import RunConfig
from difftune.errors import ConfigError
from difftune.train.setup import Run, fill_caches, prepare, text_requests
from difftune.train.validation import Validator
from difftune.verbs.check import describe_captions
from difftune.verbs.common import join, sample_prompts, sampler_for

log = logging.getLogger("difftune")


def run_cache(cfg: RunConfig, prune: bool = False, show_progress: bool = True) -> list[str]:
    """`difftune cache`: fill the caches without training (or first prune what is unused)."""
    if "disk" not in (cfg.cache.latents, cfg.cache.text):
        raise ConfigError("difftune cache fills disk caches, but neither cache.latents nor "
                          "cache.text is \"disk\"; set cache.latents = \"disk\" and/or "
                          "cache.text = \"disk\"")
    dist = join(cfg)
    run = prepare(cfg, show_progress=show_progress)
    sampler = (sampler_for(run, None, cfg.save.dir / "samples")
               if cfg.sample.prompts and dist.main else None)
    validator = Validator.of(run)  # the held-out set's latents and texts are cached too
    extra = dist.broadcast((sample_prompts(sampler) if sampler else [])
                           + (validator.captions if validator else []))
    report = []
    if prune and dist.main:
        report += _prune(run, extra, validator)
    dist.barrier()  # pruned before anyone fills
    if validator is not None:
        validator.fill()
    fill_caches(run, extra, show_progress)
    for kind, store in (("latents", run.latents.store), ("text", run.texts.store)):
        if isinstance(store, DiskStore):
            report.append(f"{kind}: {len(store)} entries in {store.dir}")
    report += describe_captions(run)
    return report


def _prune(run: Run, extra_texts: list[str], validator: Validator | None) -> list[str]:
    """Delete the disk entries this config no longer references; report the space freed."""
    lines = []
    known = [run.captions.known_texts(i) for i in range(len(run.data.items))]
    texts, images = text_requests(run, known)
    held = validator.latents.keys() if validator is not None else set()
    wanted = {"latents": lambda: run.latents.keys() | run.controls.keys() | held,
              "text": lambda: run.texts.keys(texts + extra_texts,
                                             images + [()] * len(extra_texts))}
    for kind, store in (("latents", run.latents.store), ("text", run.texts.store)):
        if isinstance(store, DiskStore):
            files, freed = store.prune(wanted[kind]())
            lines.append(f"pruned {kind}: {files} unused entries deleted, "
                         f"{freed / 2**20:.1f} MiB freed")
    return lines
