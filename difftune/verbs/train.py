"""`difftune train`: open or resume a run, hold its folder's lock, train, save, sample.

Signals (SIGINT, SIGTERM) stop the loop after the current step with a checkpoint saved."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from difftune import families
from difftune.config import RunConfig
from difftune.config.keep_best import Measure
from difftune.report.logs import attach_run_log
from difftune.report.metric_worker import MetricWorker, training_images
from difftune.report.vae_copies import run_copies
from difftune.report.metrics import Reporter, SilentReporter
from difftune.train import experts
from difftune.train.best import BestKeeper
from difftune.train.checkpoint import Checkpoint, CheckpointManager
from difftune.train.dist import Dist
from difftune.train.init_lora import load_init_lora
from difftune.train.nodes import Layout
from difftune.train.placement import log_layout
from difftune.train.loop import Hooks, Result, train
from difftune.train.validation import Validator
from difftune.train.rundir import (
    RunLock,
    clean_leftovers,
    clear_for_overwrite,
    refuse_overwrite,
)
from difftune.train.setup import (
    Run,
    fill_caches,
    load_data,
    prepare,
    report_bad_entries,
)
from difftune.verbs.common import join, sample_prompts, sampler_for

log = logging.getLogger("difftune")


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
    data = load_data(cfg, families.get(cfg.model.family, cfg.model.variant))
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
    sampler = (sampler_for(run, None, cfg.save.dir / "samples")
               if cfg.sample.prompts and dist.main else None)
    validator = Validator.of(run)
    extra = (sample_prompts(sampler) if sampler else []) + (validator.captions if validator else [])
    if validator is not None:
        validator.fill()
        log.info("validation: %d held-out images, every %d steps at %d timesteps",
                 len(validator.items), cfg.validation.every_n_steps, cfg.validation.timesteps)
    fill_caches(run, dist.broadcast(extra), show_progress)
    start = checkpoint.step if checkpoint else 0
    # The signals are taken before the reporter starts metrics.jsonl (and TensorBoard, which
    # takes a while): a Ctrl-C from then on is a stop request the loop honours after its step,
    # never a KeyboardInterrupt half-way through setting up.
    with stop_signals() as stop:  # a sample event polls it too (train.sample_events)
        reporter = (Reporter(cfg.save.dir, cfg.train.steps, start_step=start,
                             bar=show_progress, append=checkpoint is not None,
                             every=cfg.train.log_every)
                    if dist.main else SilentReporter())
        if sampler:
            sampler.reporter = reporter
        best = best_keeper(cfg, checkpoint, judges=dist.main)  # every process saves
        metrics = metric_worker(run, reporter, best) if sampler else None
        try:
            result = train(run, Hooks(reporter, ckpt, sampler, stop, validator, metrics, best),
                           checkpoint)
        finally:
            if metrics is not None:
                metrics.close()  # the last event's figures are written before the reporter closes
            reporter.close()
            line = best.finish() if best is not None else None
            if line:
                log.info("%s", line)
            report_bad_entries(run)
    log.info("done in %.1f s: %s", time.perf_counter() - started,
             ", ".join(str(p) for p in result.loras or [result.lora]))
    return result


def metric_worker(run: Run, reporter: Reporter, best: BestKeeper | None) -> MetricWorker | None:
    """The run's sample-metrics thread ([metrics] enabled), reporting to `reporter` and to
    the keep_best rule; the training images' VAE copies (what memorization compares samples
    with) are made first, here where the VAE is."""
    m = run.cfg.metrics
    if not m.enabled:
        return None
    assert run.cfg.cache.dir is not None  # set when the config loads

    def measured(step: int, figures: dict) -> None:
        reporter.sample_metrics(step, figures)
        if best is not None:
            best.record(step, figures)

    training = training_images(run.data.items)
    copies = run_copies(run, training)
    return MetricWorker(m, training, run.cfg.cache.dir, measured,
                        on_skip=best.skipped if best is not None else None, copies=copies)


def best_keeper(cfg: RunConfig, checkpoint: Checkpoint | None,
                judges: bool = True) -> BestKeeper | None:
    """The save.keep_best rule of the run (None when unset); `judges`: this process scores
    and keeps (rank 0), the others join the candidates' saves."""
    if cfg.save.keep_best is None:
        return None
    spec = families.spec(cfg.model.family, cfg.model.variant)
    return BestKeeper(Measure(cfg.save.keep_best, cfg.save.keep_best_mode), cfg.save.dir,
                      cfg.save.name, checkpoint.step if checkpoint else None,
                      experts.file_suffixes(cfg, spec), judges)


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
        kind = "sharded (FSDP)" if cfg.train.distributed == "fsdp" else "data-parallel"
        log.info("%s run: %d processes, global batch %d (train.batch_size %d per process)",
                 kind, dist.world, dist.world * cfg.train.batch_size, cfg.train.batch_size)
        log_layout(dist, Layout.from_env())
    return checkpoint


class StopRequest:
    """The stop state a SIGINT/SIGTERM sets, and the predicate the loop polls.

    The signal handler only appends to a list (async-signal-safe: a Python handler may run in
    the middle of a logging call on the same thread, whose handler lock or buffered stream is
    then held, and logging there deadlocks or raises "reentrant call", which once took the run
    log down). The messages are logged when the loop polls, outside the handler."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._told = 0

    def ask(self, signum: int, frame: object) -> None:
        """The signal handler: records the signal, nothing else."""
        self.signals.append(signum)

    def __call__(self) -> bool:
        """Whether a stop was asked for; logs the signals not logged yet (polled by the loop)."""
        self.tell()
        return bool(self.signals)

    def tell(self) -> None:
        """Log each signal received since the last call, once."""
        while self._told < len(self.signals):
            name = signal.Signals(self.signals[self._told]).name
            if self._told == 0:
                log.warning("stop requested (%s): finishing this step and saving a checkpoint",
                            name)
            else:  # a second signal never cuts a save short
                log.warning("%s again: already stopping; the checkpoint is being saved, wait for "
                            "it (kill -9 loses the steps since the last checkpoint)", name)
            self._told += 1


@contextlib.contextmanager
def stop_signals() -> Iterator[Callable[[], bool]]:
    """SIGINT/SIGTERM ask the loop to finish its step, checkpoint and stop (a second SIGINT
    is ignored until then); yields the predicate the loop polls. Off the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    stop = StopRequest()
    old = {s: signal.signal(s, stop.ask) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        stop.tell()  # a signal during the final save is logged, late rather than never
        for sig, handler in old.items():
            signal.signal(sig, handler)
