"""What the CLI verbs do, as plain functions (the CLI only parses and maps errors to exit codes)."""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from difftune import families
from difftune.adapters.lora import lora_parameters
from difftune.cache.disk import DiskStore
from difftune.config import RunConfig
from difftune.errors import ConfigError, DataError
from difftune.data.discover import DataSet
from difftune.logs import attach_run_log, quiet_rank
from difftune.memory import savers
from difftune.precision import resolve_device
from difftune.report import Reporter, SilentReporter
from difftune.sample import SampleRunner
from difftune.train.checkpoint import Checkpoint, CheckpointManager
from difftune.train.checkpoint.lora import lora_format
from difftune.train.dist import Dist, init as init_dist
from difftune.train.init_lora import load_init_lora
from difftune.train.loop import Hooks, Result, set_training, train
from difftune.train.rundir import RunLock, clean_leftovers, clear_for_overwrite, refuse_overwrite
from difftune.train.setup import Run, fill_caches, load_data, prepare, report_bad_entries
from difftune.train.step import batch_loss

log = logging.getLogger("difftune")


def _sampler(run: Run, reporter: Reporter | None, out: Path) -> SampleRunner:
    """A sample runner whose default size is the first dataset's resolution."""
    res = run.cfg.datasets[0].resolution
    return SampleRunner(run.family, run.comps, run.texts, run.cfg.sample, out, (res, res),
                        run.policy, reporter)


def _sample_prompts(runner: SampleRunner) -> list[str]:
    """Prompt and negative texts of the sample file now, so they are cached with the captions."""
    specs = runner.prompts()
    return [s.prompt for s in specs] + [s.negative for s in specs if s.cfg > 1.0]


def run_train(cfg: RunConfig, show_progress: bool = True, resume: str | None = None,
              init_lora: Path | None = None) -> Result:
    """`difftune train`: the whole run, from config to LoRA file.

    `resume` ("latest" or a checkpoint folder) continues a run exactly; `init_lora` starts a
    new one from a LoRA file's weights. An incompatible resume fails before anything is written.
    """
    dist = join(cfg)
    lock = RunLock(cfg.save.dir)
    try:
        checkpoint = _open_run(cfg, resume, dist, lock)
        return _run_locked(cfg, dist, checkpoint, show_progress, init_lora)
    finally:
        lock.release()


def _run_locked(cfg: RunConfig, dist: Dist, checkpoint: Checkpoint | None,
                show_progress: bool, init_lora: Path | None) -> Result:
    """The run once its folder is held: data (checked against a resumed checkpoint before the
    model loads), model, caches, training."""
    started = time.perf_counter()
    data = load_data(cfg, families.get(cfg.model.family))
    if checkpoint is not None:
        CheckpointManager.check_data(checkpoint, data, cfg.train.batch_size * dist.world,
                                     cfg.train.seed)
    run = prepare(cfg, dataset=data, show_progress=show_progress)
    ckpt = CheckpointManager(cfg, run.family, run.comps, run.targets, run.data.summary(),
                             run.embeddings, writes=dist.main)
    if checkpoint is not None:
        ckpt.check_compatible(checkpoint)
    ckpt.check_space()
    if init_lora is not None:
        load_init_lora(init_lora, ckpt)
    ckpt.write_config()
    sampler = (_sampler(run, None, cfg.save.dir / "samples")
               if cfg.sample.prompts and dist.main else None)
    fill_caches(run, dist.broadcast(_sample_prompts(sampler) if sampler else []), show_progress)
    start = checkpoint.step if checkpoint else 0
    reporter = (Reporter(cfg.save.dir, cfg.train.steps, start_step=start, bar=show_progress,
                         append=checkpoint is not None, every=cfg.train.log_every)
                if dist.main else SilentReporter())
    if sampler:
        sampler.reporter = reporter
    try:
        with stop_signals() as stop:
            if sampler:
                sampler.stop = stop
            result = train(run, Hooks(reporter, ckpt, sampler, stop), checkpoint)
    finally:
        reporter.close()
        report_bad_entries(run)
    log.info("done in %.1f s: %s", time.perf_counter() - started, result.lora)
    return result


def _open_run(cfg: RunConfig, resume: str | None, dist: Dist,
              lock: RunLock) -> Checkpoint | None:
    """Hold the output folder (rank 0), check what the run would overwrite or resume from
    (every process, before rank 0 writes anything), then clean what an interrupted run left
    and open the run log; returns the checkpoint to resume."""
    if dist.main:
        lock.acquire()  # a second run on this folder stops here
    checkpoint = CheckpointManager.open(cfg, resume) if resume else None
    if checkpoint is None:
        refuse_overwrite(cfg)
    dist.barrier()
    if dist.main:
        clean_leftovers(cfg.save.dir)
        if checkpoint is None:
            clear_for_overwrite(cfg)
        attach_run_log(cfg.save.dir / "difftune.log")  # appends: a refused resume loses nothing
    if dist.world > 1:
        log.info("data-parallel run: %d processes, global batch %d (train.batch_size %d per "
                 "process)", dist.world, dist.world * cfg.train.batch_size, cfg.train.batch_size)
    return checkpoint


def join(cfg: RunConfig) -> Dist:
    """This process's place in a multi-process run (launched by accelerate or torchrun), or
    a single process; only rank 0 then speaks on the console (warnings of others: errors only)."""
    dist = init_dist(resolve_device(cfg.train.device))
    if dist.world > 1:
        quiet_rank(dist.rank)
    return dist


@contextlib.contextmanager
def stop_signals() -> Iterator[Callable[[], bool]]:
    """SIGINT/SIGTERM ask the loop to finish its step, checkpoint and stop (a second SIGINT
    is ignored until then); yields the predicate the loop polls. Off the main thread, nothing."""
    asked: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def ask(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if not asked:
            log.warning("stop requested (%s): finishing this step and saving a checkpoint", name)
        else:  # a second signal never cuts a save short
            log.warning("%s again: already stopping; the checkpoint is being saved, wait for "
                        "it (kill -9 loses the steps since the last checkpoint)", name)
        asked.append(signum)

    old = {s: signal.signal(s, ask) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(asked)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_cache(cfg: RunConfig, prune: bool = False, show_progress: bool = True) -> list[str]:
    """`difftune cache`: fill the caches without training (or first prune what is unused)."""
    if "disk" not in (cfg.cache.latents, cfg.cache.text):
        raise ConfigError("difftune cache fills disk caches, but neither cache.latents nor "
                          "cache.text is \"disk\"; set cache.latents = \"disk\" and/or "
                          "cache.text = \"disk\"")
    dist = join(cfg)
    run = prepare(cfg, show_progress=show_progress)
    sampler = (_sampler(run, None, cfg.save.dir / "samples")
               if cfg.sample.prompts and dist.main else None)
    extra = dist.broadcast(_sample_prompts(sampler) if sampler else [])
    report = []
    if prune and dist.main:
        report += _prune(run, extra)
    dist.barrier()  # pruned before anyone fills
    fill_caches(run, extra, show_progress)
    for kind, store in (("latents", run.latents.store), ("text", run.texts.store)):
        if isinstance(store, DiskStore):
            report.append(f"{kind}: {len(store)} entries in {store.dir}")
    report += describe_captions(run)
    return report


def _prune(run: Run, extra_texts: list[str]) -> list[str]:
    """Delete the disk entries this config no longer references; report the space freed."""
    lines = []
    known = [run.captions.known_texts(i) for i in range(len(run.data.items))]
    texts = [t for k in known if k is not None for t in k] + extra_texts
    wanted = {"latents": run.latents.keys, "text": lambda: run.texts.keys(texts)}
    for kind, store in (("latents", run.latents.store), ("text", run.texts.store)):
        if isinstance(store, DiskStore):
            files, freed = store.prune(wanted[kind]())
            lines.append(f"pruned {kind}: {files} unused entries deleted, "
                         f"{freed / 2**20:.1f} MiB freed")
    return lines


def describe_captions(run: Run) -> list[str]:
    """How each subset's caption augmentations reach the model (printed by check and cache)."""
    seen: dict[tuple[int, int], int] = {}
    for i, item in enumerate(run.data.items):
        seen.setdefault((item.dataset, item.subset), i)
    lines = []
    for (d, s), i in sorted(seen.items()):
        words = run.captions.describe(i)
        if not words:
            continue
        live = ""
        if run.embeddings is not None and any(
                e.name in run.captions.text(i, None, 0) for e in run.cfg.adapter.embeddings):
            live = ("; captions with a learned placeholder are encoded live by the encoders "
                    "learning it")
        lines.append(f"captions of datasets[{d}].subsets[{s}]: {', '.join(words)}; "
                     + _caption_mode(run, i) + live)
    return lines


def _caption_mode(run: Run, index: int) -> str:
    """Whether an item's augmented captions are cached, pre-encoded as variants, or live."""
    cache, k = run.cfg.cache, run.cfg.cache.caption_variants
    item = run.data.items[index]
    random_part = item.augment.is_random(item.augment.fixed(item.caption))
    if cache.text == "none":
        return "text encoded every step (cache.text = \"none\")" + (
            f", {k} variants per caption" if random_part and k else "")
    if random_part and k:
        return f"{k} variants per caption pre-encoded from the seed (cache.caption_variants)"
    if random_part:
        return ("a fresh draw per sample, encoded on demand with the cache as a memo; the "
                "text encoders stay resident (set cache.caption_variants = K to pre-encode)")
    return "every text it can produce is pre-encoded and cached"


def _describe_data(data: DataSet) -> list[str]:
    """The dataset summary lines `check` prints: counts, buckets, each skipped file and why."""
    s = data.summary()
    lines = [f"dataset: {s['images']} images, {s['skipped']} skipped, "
             f"{s['captions_missing']} without caption"]
    lines += [f"  bucket {b}: {n}" for b, n in sorted(s["buckets"].items())]
    lines += [f"  skipped {p}: {why}" for p, why in data.skipped]
    return lines


def run_check(cfg: RunConfig) -> list[str]:
    """`difftune check`: everything a run does, once, at the smallest size; returns the report."""
    report = ["config: valid"]
    refuse_overwrite(cfg)
    if cfg.save.dir.is_dir():
        RunLock(cfg.save.dir).acquire().release()  # raises while another run holds it
    report.append(f"output folder: {cfg.save.dir} (nothing would be overwritten)")
    data = load_data(cfg, families.get(cfg.model.family))
    report += _describe_data(data)
    run = prepare(cfg, dataset=data, show_progress=False)
    report.append(f"model: {run.comps.name} loaded on {run.policy.device}; LoRA rank "
                  f"{cfg.adapter.rank} on {len(run.targets)} layers")
    report.append(savers.describe(cfg, run.family, run.comps.denoiser))
    if cfg.adapter.type == "lora":
        report.append(_format_line(run))
    areas = [it.bucket[0] * it.bucket[1] for it in data.items]
    smallest = areas.index(min(areas))
    gen = torch.Generator("cpu").manual_seed(cfg.train.seed)
    set_training(run, True)
    loss = batch_loss(run, [smallest], [False], gen)
    if loss is None:
        raise DataError(f"{data.items[smallest].path} cannot be read (see the warning above); "
                        "replace or remove it")
    if loss.requires_grad:  # false only when nothing trained is used (a caption without
        loss.backward()     # the placeholder of a textual-inversion run)
    value = float(loss.detach())
    if not torch.isfinite(loss):
        raise RuntimeError(f"the check step gave a non-finite loss ({value})")
    caption = run.captions.text(smallest, None, 0)
    flow = _gradient_flow(run, caption)
    report.append(f"training step: loss {value:.4f}, gradients flow into "
                  + (", ".join(flow) if flow else "nothing this step trains (its caption "
                     "uses no placeholder)"))
    report += _placeholder_report(run)
    report += describe_captions(run)
    report += _check_sample(run)
    return report


def _format_line(run: Run) -> str:
    """Which key layout the LoRA will be written in, and why."""
    save = run.cfg.save
    why = ("set by save.format" if save.format else
           f"the {run.family.name} default: the layout ComfyUI and diffusers both read "
           "fully; set save.format to choose")
    return f"LoRA file format: {lora_format(save, run.family)} ({why})"


def _gradient_flow(run: Run, caption: str) -> list[str]:
    """What got a gradient in the check step (LoRAs, and embeddings `caption` uses); raises
    if one got none."""
    groups: dict[str, list[torch.nn.Parameter]] = {}
    if run.cfg.adapter.type == "lora":
        groups["the denoiser"] = lora_parameters(run.comps.denoiser)
    groups |= {f"text encoder {n}": lora_parameters(m) for n, m in run.trained_encoders.items()}
    if run.embeddings is not None:
        for item in run.embeddings.learned:
            if item.spec.name in caption:
                groups[f"{item.spec.name} in {item.encoder}"] = [run.embeddings.tensor_of(item)]
    for label, params in groups.items():
        if not any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params):
            raise RuntimeError(f"the check step gave no gradient in {label}")
    return list(groups)


def _placeholder_report(run: Run) -> list[str]:
    """How many captions use each placeholder (none is a mistake worth seeing in seconds)."""
    if run.embeddings is None:
        return []
    captions = [run.captions.text(i, None, 0) for i in range(len(run.data.items))]
    lines = []
    for spec in run.cfg.adapter.embeddings:
        used = sum(spec.name in c for c in captions)
        lines.append(f"placeholder {spec.name}: in {used} of {len(captions)} captions"
                     + ("" if used else " (none: add it to the captions or caption_prefix, or "
                        "nothing will train it)"))
    return lines


def _check_sample(run: Run) -> list[str]:
    if run.cfg.sample.prompts is None:
        return ["sampling: no prompt file configured (sample.prompts); skipped"]
    runner = _sampler(run, None, Path())
    specs = runner.prompts()
    step = run.family.bucket_step * 2
    probe = [replace(s, width=step, height=step, steps=1) for s in specs[:1]]
    if not probe:
        return [f"sampling: {run.cfg.sample.prompts} holds no usable prompt"]
    with tempfile.TemporaryDirectory() as tmp:
        images = runner.run(0, probe, Path(tmp))
    if not images:
        return ["sampling: FAILED (see the warning above); training would go on without samples"]
    return [f"sampling: {len(specs)} prompt(s) read; a 1-step {step}x{step} sample works"]
