"""Everything a run needs before its first step, shared by `train`, `check` and the benchmarks.

Order matters for the promise "fail in seconds, not hours": cheap checks (output folder, data
discovery) run before the model loads, and the model loads before any caching starts.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import torch
from tqdm import tqdm

from difftune import data, families

from difftune.precision import lowbit
from difftune.adapters import full
from difftune.adapters.embeddings import Embeddings
from difftune.adapters.kinds import AdapterOptions
from difftune.adapters.lora import add_lora, suffix_patterns
from difftune.cache import make_store
from difftune.cache.store import MemoryStore, Store
from difftune.cache.controls import ControlSource
from difftune.cache.sources import LatentSource, TextSource
from difftune.config import RunConfig
from difftune.config.adapter import AdapterConfig
from difftune.data import class_images, holdout
from difftune.data.captions import Captions
from difftune.data.clips import clip_rule
from difftune.data.discover import DataSet
from difftune.families.base import Components, Family, blocks_of, start_encoders
from difftune.families.common.experts import Experts
from difftune.families.common.text import EncodeOptions
from difftune.memory import savers
from difftune.precision.policy import PrecisionPolicy, resolve_device
from difftune.train import experts, preservation, sharding
from difftune.train.dist import Dist, current
from difftune.train.objectives import Objective

log = logging.getLogger("difftune")


@dataclass
class Run:
    """The loaded parts of a run."""

    cfg: RunConfig
    family: Family
    policy: PrecisionPolicy
    data: DataSet
    comps: Components
    latents: LatentSource
    texts: TextSource
    targets: list[str]
    objective: Objective
    captions: Captions
    text_targets: dict[str, list[str]] = field(default_factory=dict)
    embeddings: Embeddings | None = None
    dist: Dist = field(default_factory=Dist)
    controls: ControlSource = field(init=False)
    # Per-step figures besides the loss (e.g. loss_preservation), one value per micro-batch.
    extras: dict[str, list[float]] = field(default_factory=dict)
    # A two-expert model's turns (which expert trains each step, on which times); None: one
    # denoiser.
    turns: experts.Turns | None = None

    def __post_init__(self) -> None:
        """Edit pairs' control latents share the latent store (their keys are their own)."""
        self.controls = ControlSource(self.family, self.comps, self.data.items,
                                      self.latents.store,
                                      tuple(d.resolutions[0] for d in self.cfg.datasets))

    @property
    def trained_encoders(self) -> dict[str, torch.nn.Module]:
        """The text encoders that carry a LoRA, by name."""
        return {n: self.comps.text_encoders[n] for n in self.text_targets}

    @property
    def sharded(self) -> bool:
        """Whether the denoiser is FSDP-sharded: every process must then run every forward
        and backward (each one gathers and reduces with the others)."""
        return self.cfg.train.distributed == "fsdp" and self.dist.world > 1

    @property
    def out(self) -> Path:
        """The output folder."""
        return self.cfg.save.dir


def set_training(run: Run, on: bool) -> None:
    """Train (dropout on) or eval mode for every module with a LoRA: denoiser and encoders."""
    for module in (run.comps.denoiser, *run.trained_encoders.values()):
        module.train(on)


def progress(show: bool) -> Any:
    """A progress wrapper for cache filling (tqdm when shown)."""
    def wrap(it: Iterable, desc: str, total: int) -> Iterable:
        return tqdm(it, desc=desc, total=total, disable=not show, leave=False)
    return wrap


def load_data(cfg: RunConfig, family: Family) -> DataSet:
    """Discover the datasets (cheap: no model needed); warns about every skipped file. Edit
    pairs' control images are sized by the family's rule (`Family.control_size`); the
    validation set is split off into `held` (data/holdout.py). Folders of class images
    still to generate are made (empty) first."""
    class_images.make_folders(cfg)
    found = data.build(cfg.datasets, family.bucket_step, family.control_size,
                       clip_rule(family))
    stills = sum(it.clip is None for it in found.items)
    if family.start_image and stills:  # (check prints the note with the dataset's lines)
        found.notes.append(f"{stills} still image(s): an image-to-video model is conditioned "
                           "on each sample's first frame, so a still image trains it to keep "
                           "its start frame unchanged; train on video clips")
        log.warning("%s", found.notes[-1])
    return holdout.split(cfg, found, family.bucket_step, family.control_size)


def warn_distilled(cfg: RunConfig, family: Family, comps: Components) -> None:
    """Say, before any training, that the loaded base is a step-distilled checkpoint and what
    training it does (the family spec's note); a full fine-tune or a LoRA alike."""
    note = families.spec(cfg.model.family, cfg.model.variant).distilled_note
    if note and family.distilled(comps):
        log.warning("distilled base: %s", note)


def prepare(cfg: RunConfig, dataset: DataSet | None = None, show_progress: bool = True,
            class_images_too: bool = True) -> Run:
    """Load the model, make missing class images (unless `class_images_too` is False: `check`
    only counts them), add the LoRA and set up the caches (not yet filled)."""
    family = families.get(cfg.model.family, cfg.model.variant)
    dataset = dataset or load_data(cfg, family)
    device = resolve_device(cfg.train.device)
    savers.check(cfg, family, device, current().world)
    policy = replace(PrecisionPolicy.from_config(cfg.precision, device),
                     denoiser_device=savers.denoiser_home(cfg, current().world))
    log.info("loading %s model (%s)", family.name, cfg.model.flavor or cfg.model.path or "files")
    comps = family.load(cfg.model, policy)
    warn_distilled(cfg, family, comps)
    lowbit.apply_to_components(comps, family, policy, cfg.precision.quantize)
    if class_images_too and any(n.missing for n in class_images.needs(cfg)):
        if current().main:  # one process writes them, the others wait and read them
            class_images.generate(cfg, family, comps, policy, show_progress)
        current().barrier()
        dataset = load_data(cfg, family)  # the new class images join the data
    a = cfg.adapter
    targets: list[str] = []
    turns = experts.turns(cfg, families.spec(cfg.model.family, cfg.model.variant))
    experts.set_boundary(cfg, comps.denoiser)
    if a.peft_kind is not None:
        patterns = (suffix_patterns(a.target_modules) if a.target_modules
                    else family.lora_targets(a.targets))
        patterns = turns.patterns(patterns) if turns is not None else patterns
        convs = list(family.conv_targets) if a.conv_rank is not None else None
        targets = add_lora(comps.denoiser, patterns, a.rank, a.scale_alpha, a.dropout,
                           cfg.train.seed, a.peft_kind, adapter_options(a), convs)
    elif a.type == "full":
        targets = full.make_trainable(comps.denoiser, a.train_blocks)
    if isinstance(comps.denoiser, Experts):  # both LoRAs stay on the accelerator
        comps.denoiser.trained_to_device()
    if cfg.train.gradient_checkpointing:
        comps.denoiser.enable_gradient_checkpointing()
    savers.apply(cfg, family, comps.denoiser, policy.device)
    if cfg.train.distributed == "fsdp" and current().world > 1:
        sharding.shard(comps.denoiser, blocks_of(comps.denoiser, family.compile_blocks),
                       policy.device, policy.mixed)
    text_targets = add_text_encoder_loras(cfg, comps)
    embeddings = Embeddings(a.embeddings, family, comps) if a.embeddings else None
    c = cfg.cache
    latents = LatentSource(family, comps, dataset.items, make_store(c.latents, c.dir, "latents"),
                           cfg.train.seed, fresh_crops=c.latents == "none")
    options = EncodeOptions(t5_mask=cfg.model.t5_mask, clip_skip=cfg.model.clip_skip)
    texts = TextSource(family, comps, make_store(c.text, c.dir, "text"), options, text_targets,
                       reload=lambda: reload_text_encoders(cfg, family, policy),
                       embeddings=embeddings)
    objective = family.objective(comps, cfg.train)
    captions = Captions(dataset.items, cfg.train.seed, c.caption_variants)
    if preservation.unused(dataset.items, cfg.preservation):
        log.warning("preservation.trigger %r is in no caption: output preservation will not "
                    "act; check its spelling", cfg.preservation.trigger)
    return Run(cfg, family, policy, dataset, comps, latents, texts, targets, objective,
               captions, text_targets, embeddings, current(), turns=turns)


def reload_text_encoders(cfg: RunConfig, family: Family, policy: PrecisionPolicy
                         ) -> dict[str, torch.nn.Module]:
    """The text encoders from their files, at the run's precision (after an unload)."""
    encoders = family.load_text_encoders(cfg.model, policy)
    lowbit.apply_to_part("text_encoders", encoders, family, policy,
                         cfg.precision.quantize.text_encoders, policy.compute)
    return encoders


def add_text_encoder_loras(cfg: RunConfig, comps: Components) -> dict[str, list[str]]:
    """The run's adapter kind (fp32, seeded like the denoiser's) on each text encoder the
    config trains (Linear layers only: conv options are the denoiser's), or with
    adapter.type = "full" the encoder's own weights (fp32 master weights).

    Returns the targeted module (full: parameter) names per encoder; the names were
    validated at config load.
    """
    a = cfg.adapter
    if a.type == "full":
        return {name: full.make_trainable(comps.text_encoders[name], None)
                for name in a.text_encoders}
    patterns = suffix_patterns(a.text_encoder_targets)
    return {name: add_lora(comps.text_encoders[name], patterns, a.rank, a.scale_alpha,
                           a.dropout, cfg.train.seed, a.peft_kind or "lora", adapter_options(a))
            for name in a.text_encoders}


def adapter_options(a: AdapterConfig) -> AdapterOptions:
    """The adapter section's numbers as the kind registry takes them."""
    if a.full_matrix and a.alpha is not None:
        log.warning("adapter.alpha has no effect with adapter.full_matrix: a full-rank LoKr is "
                    "scaled by 1, as LyCORIS and ComfyUI read it")
    return AdapterOptions(rank=a.rank, alpha=a.scale_alpha, dropout=a.dropout, dora=a.dora,
                          factor=a.factor, decompose_both=a.decompose_both,
                          full_matrix=a.full_matrix, conv_rank=a.conv_rank,
                          conv_alpha=a.conv_alpha)


def fill_caches(run: Run, extra_texts: list[str], show_progress: bool = True) -> None:
    """Compute every cacheable latent and text embedding, then offload what is done.

    Text encoders stay resident when some captions are drawn afresh per sample (random
    augmentations with `cache.caption_variants = 0`): those texts are encoded on demand.
    """
    cache, dist = run.cfg.cache, run.dist
    wrap = progress(show_progress and dist.main)
    if cache.latents != "none":
        share_cache(run.latents.store, run.latents.fill(wrap, dist.share), dist)
        share_cache(run.latents.store, run.controls.fill(wrap, dist.share), dist)
    live = False
    if cache.text != "none":
        known = [run.captions.known_texts(i) for i in range(len(run.data.items))]
        live = any(k is None for k in known)
        texts, images = text_requests(run, known)
        images += [()] * len(extra_texts)
        share_cache(run.texts.store, run.texts.fill(texts + extra_texts, wrap, dist.share,
                                                    images), dist)
    report_bad_entries(run)
    dist.barrier()  # every process's disk entries are written before anyone reads them
    if cache.unload_text_encoders:
        log.info("text encoders %s unloaded (reloaded from their files for new text)",
                 ", ".join(run.texts.unload()))
        gc.collect()
    if cache.offload and run.policy.device.type != "cpu":
        for module in offloaded(run, live):
            module.to("cpu")
        torch.cuda.empty_cache()


def offloaded(run: Run, live: bool) -> list[torch.nn.Module]:
    """What leaves the accelerator once the caches are filled (`cache.offload`): the VAE and
    the image encoders that encode with it when latents are cached, and the frozen text
    encoders when every text is (`live`: some are encoded per step). Trained encoders run
    every step, so they stay."""
    cache, out = run.cfg.cache, []
    if cache.latents != "none":
        out += [run.comps.vae, *start_encoders(run.comps)]
    if cache.text != "none" and not live:
        learning = run.embeddings.encoders() if run.embeddings else set()
        out += [encoder for name, encoder in run.comps.text_encoders.items()
                if name not in run.text_targets and name not in learning and encoder is not None]
    return out


def text_requests(run: Run, known: list[list[str] | None]) -> tuple[list[str], list]:
    """The texts to cache (each with the images its encoder reads): the items' known texts
    and, with output preservation, their trigger-free twins."""
    texts, images = run.controls.text_requests(known)
    free, free_images = preservation.free_texts(texts, images, run.cfg.preservation)
    return texts + free, images + free_images


def share_cache(store: Store, computed: list[str], dist: Dist) -> None:
    """Several processes fill one cache, each its share, once: memory entries are then sent
    to every process (disk entries are read from the shared folder)."""
    if dist.world == 1 or not isinstance(store, MemoryStore):
        return
    mine = {key: store.get(key) for key in computed}
    for part in dist.gather(mine):
        for key, tensors in part.items():
            if key not in store:
                store.put(key, tensors, {})


def report_bad_entries(run: Run) -> None:
    """Finish queued cache writes; one warning per cache for the corrupt entries it found."""
    for store in (run.latents.store, run.texts.store):
        # Only disk stores queue writes and can hold bad entries.
        flush, report = getattr(store, "flush", None), getattr(store, "report", None)
        if flush:
            flush()
        message = report() if report else None
        if message:
            log.warning("%s", message)
