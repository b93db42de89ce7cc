"""The training loop: batches -> loss -> backward -> optimizer -> hooks.

Randomness (noise, timesteps) comes from one CPU generator seeded from `train.seed`, the data
order from the seeded bucket sampler and the LoRA init from the same seed, so the same config
gives the same LoRA on the CPU. Hooks (reporting, saving, sampling) run between steps and never
touch that generator. Everything that changes as the run trains (besides the weights) is one
`TrainState` (state.py), which the checkpoint manager saves and loads; a batch's loss comes
from step.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from difftune.adapters.full import trained_parameters
from difftune.data.sampler import Batch, BucketBatchSampler
from difftune.report.metric_worker import MetricWorker
from difftune.report.metrics import Reporter
from difftune.sample.runner import SampleRunner
from difftune.train.best import BestKeeper
from difftune.train.checkpoint import Checkpoint, CheckpointManager
from difftune.train.ema import Ema, using
from difftune.train.guard import NonFiniteGuard, TrainingDiverged
from difftune.train.optimizers.build import make_optimizer
from difftune.train import requests
from difftune.train.preservation import step_metrics
from difftune.train.optimizers.modes import step_lr
from difftune.train.optimizers.schedule import make_scheduler
from difftune.train.rng import RunRngs, seed_everything
from difftune.train.sample_events import sample_event
from difftune.train.setup import Run, set_training
from difftune.train.state import Snapshot, TrainState
from difftune.train.step import batch_loss
from difftune.train.validation import Validator
from difftune.train.validating import validate

log = logging.getLogger("difftune")


@dataclass
class Hooks:
    """What happens between steps; `stop` says a stop was asked for (SIGINT/SIGTERM);
    `validator` measures the validation loss (None: the run has no validation set);
    `metrics` measures each sample event's images in its own thread (None: [metrics] off);
    `best` keeps the best step's LoRA by save.keep_best (None: unset)."""

    reporter: Reporter
    checkpoints: CheckpointManager
    sampler: SampleRunner | None
    stop: Callable[[], bool] = lambda: False
    validator: Validator | None = None
    metrics: MetricWorker | None = None
    best: BestKeeper | None = None


class StepFailed(Exception):
    """Step `step` failed with `cause`; the state after the step before it (the last good
    one) was saved to `path` (None when it could not be: nothing trained yet, or the
    weights already half-updated). Single-process runs only: in a multi-process run the
    failure is raised as it is, and every process stops."""

    def __init__(self, step: int, path: Path | None, cause: BaseException) -> None:
        super().__init__(f"step {step} failed: {type(cause).__name__}: {cause}")
        self.step, self.path, self.cause = step, path, cause


class Interrupted(Exception):
    """Training stopped on request after `step`; a checkpoint was saved to `path`."""

    def __init__(self, step: int, path: Path) -> None:
        super().__init__(f"stopped after step {step}; checkpoint {path}")
        self.step, self.path = step, path


@dataclass
class Result:
    """What a finished run produced."""

    losses: list[float] = field(default_factory=list)
    lora: Path | None = None
    loras: list[Path] = field(default_factory=list)  # all of the final save (a pair: experts)


def _due(step: int, every: int | None) -> bool:
    return every is not None and step % every == 0


def train(run: Run, hooks: Hooks, resume: Checkpoint | None = None) -> Result:
    """Run `train.steps` optimizer steps (from a checkpoint's step when resuming); returns
    per-step losses and the final LoRA path. Raises `Interrupted` after saving a checkpoint
    when `hooks.stop()` turns true."""
    cfg = run.cfg
    state = build_state(run, hooks.checkpoints.names())
    if resume is not None:
        hooks.checkpoints.load(resume, state)
        log.info("resumed from %s at step %d", resume.path, state.step)
    else:
        seed_everything(cfg.train.seed)
        if cfg.sample.at_start:
            sample_event(run, hooks, state, 0)
    start = state.step
    run.dist.broadcast_params(state.params)
    if run.dist.rank > 0:  # its own dropout masks (rank 0 keeps the single-process stream)
        seed_everything(cfg.train.seed + 7919 * run.dist.rank + start)
    batches = state.sampler.batches()
    result = Result()
    set_training(run, True)
    for step in range(start + 1, cfg.train.steps + 1):
        loss, epoch, lr = _guarded_step(run, hooks, state, batches, step)
        state.step = step
        result.losses.append(loss)
        extra = {"epoch": epoch, **state.guard.counts(), **step_metrics(run.extras)}
        stopping = validate(run, hooks, state, step, extra)
        hooks.reporter.step(step, loss, lr, extra)
        if stopping:
            break
        if step < cfg.train.steps:
            _between_steps(run, hooks, state, step)
    set_training(run, False)
    # Requests made during the last step: the final save answers "save", "sample" samples.
    asked = requests.take_requests(run.out) if run.dist.main else set()
    with state.eval_weights(), using(state.ema, "saves"):
        result.lora = hooks.checkpoints.save_lora(state.step, final=True)
    result.loras = list(hooks.checkpoints.written) or [result.lora]
    hooks.checkpoints.save(state)
    if cfg.sample.at_end or requests.SAMPLE in asked:  # the other processes have gone on
        sample_event(run, hooks, state, state.step, every_process=False)
    return result


def train_plain(run: Run) -> Result:
    """Train with metrics and checkpoints but no sampler, validator or stop (benches, tests)."""
    cfg = run.cfg
    reporter = Reporter(cfg.save.dir, cfg.train.steps, bar=False)
    try:
        return train(run, Hooks(reporter, CheckpointManager(cfg, run.family, run.comps,
                                                            run.targets, {}), None))
    finally:
        reporter.close()


def build_state(run: Run, names: dict[int, str]) -> TrainState:
    """A fresh training state: the configured optimizer over the LoRA groups, schedule,
    scaler, noise generator, data sampler and non-finite guard; `names` are the parameters'
    canonical names (the checkpoint manager's)."""
    cfg = run.cfg
    groups = param_groups(run)
    opt = make_optimizer(groups, cfg.train)
    params = [p for g in groups for p in g["params"]]
    return TrainState(
        opt=opt, sched=make_scheduler(opt, cfg.train),
        scaler=torch.amp.GradScaler(run.policy.device.type,
                                    enabled=cfg.precision.mixed == "fp16"),
        rngs=RunRngs(torch.Generator("cpu").manual_seed(cfg.train.seed)),
        # The global batch: each of the processes trains on its rows of it.
        sampler=BucketBatchSampler(run.data, cfg.train.batch_size * run.dist.world,
                                   cfg.train.seed),
        guard=NonFiniteGuard(cfg.train.max_nonfinite_steps, cfg.precision.mixed, cfg.train.lr),
        names=names, train=cfg.train, params=params,
        ema=Ema(params, names, cfg.train.ema) if cfg.train.ema.enabled else None)


def _guarded_step(run: Run, hooks: Hooks, state: TrainState, batches: Iterator[Batch],
                  step: int) -> tuple[float, int, float]:
    """`_step`, and when it fails before the optimizer touched the weights, a checkpoint of
    the step before (the last good one) so the run resumes from there once the cause is
    fixed; the failure is raised as `StepFailed`."""
    snap = state.snapshot()  # after step - 1
    try:
        return _step(run, hooks, state, batches, step)
    except TrainingDiverged:
        raise
    except Exception as err:
        if run.dist.world > 1:  # the other processes stop too; the CLI says which failed
            raise
        path = None
        # With fused_backward the weights change during backward: no state is whole then.
        if snap.step > 0 and not state.updating and not run.cfg.train.fused_backward:
            path = _rescue(hooks, state, snap)
        raise StepFailed(step, path, err) from err


def _rescue(hooks: Hooks, state: TrainState, snap: Snapshot) -> Path | None:
    """Save the checkpoint of `snap`'s step; None (logged) if that fails too."""
    state.rewind(snap)
    try:
        return hooks.checkpoints.save(state)
    except Exception:  # the original failure is the one to report
        log.exception("the checkpoint of the last good step could not be saved")
        return None


def _step(run: Run, hooks: Hooks, state: TrainState, batches: Iterator[Batch],
          step: int) -> tuple[float, int, float]:
    """One optimizer step (or a skipped one) of the turn's expert; returns (loss, epoch, lr)."""
    run.objective.window = run.turns.window(step - 1) if run.turns else None
    loss, epoch = _accumulate(run, batches, state.generator, state.scaler, step - 1)
    loss = run.dist.average(state.params, loss)  # one process: nothing to do
    if not state.guard.skip(step, loss):
        state.updating = True
        lr = _optimizer_step(state.opt, state.sched, state.scaler, state.params,
                             run.cfg.train.max_grad_norm)
        state.updating = False
        state.guard.scaler_skipped(state.scaler)
        if state.ema is not None:
            state.ema.update(step)
        return loss, epoch, lr
    # Nothing is applied: gradients dropped, schedule advanced to stay on the step count.
    state.opt.zero_grad(set_to_none=True)
    lr = step_lr(state.opt)
    state.sched.step()
    if state.guard.exhausted:
        set_training(run, False)
        with state.eval_weights():
            path = hooks.checkpoints.save_lora(step)
        raise TrainingDiverged(state.guard.message(step, path))
    return loss, epoch, lr


def param_groups(run: Run) -> list[dict[str, Any]]:
    """Optimizer groups: the denoiser's trained weights (LoRA, or its own for a full
    fine-tune) at train.lr, the text encoders' at their own lr."""
    kind = run.cfg.adapter.type
    groups: list[dict[str, Any]] = [{"params": trained_parameters(run.comps.denoiser, kind)}]
    encoders = run.trained_encoders
    if encoders:
        lr = run.cfg.adapter.text_encoder_lr or run.cfg.train.lr
        params = [p for e in encoders.values() for p in trained_parameters(e, kind)]
        groups.append({"params": params, "lr": lr})
    if run.embeddings is not None:
        groups.append({"params": list(run.embeddings.parameters().values()),
                       "lr": run.cfg.adapter.embedding_lr or run.cfg.train.lr,
                       "weight_decay": 0.0})  # decay would pull the vectors to zero
    return [g for g in groups if g["params"]]


def _accumulate(run: Run, batches: Iterator[Batch], generator: torch.Generator,
                scaler: torch.amp.GradScaler, done: int) -> tuple[float, int]:
    """Forward and backward over `grad_accum` micro-batches; returns (mean loss, epoch).

    `done` is the number of optimizer steps already taken (what token warm-up counts). A loss
    that reaches no trained weight (textual inversion on captions without the placeholder) is
    counted but has nothing to backpropagate.
    """
    accum = run.cfg.train.grad_accum
    total: torch.Tensor | float = 0.0
    for _ in range(accum):
        batch = next(batches)
        loss = _share_loss(run, batch, generator, done)
        if loss is None:  # this process's share of a short last batch is empty
            continue
        # Skipping the no-op division and scaling keeps the common case free of extra kernels.
        scaled = loss / accum if accum > 1 else loss
        # A non-finite loss is never backpropagated, except in a sharded run, where every
        # process must join every backward (the guard then drops the step's gradients).
        if scaled.requires_grad and (run.sharded or bool(torch.isfinite(scaled))):
            (scaler.scale(scaled) if scaler.is_enabled() else scaled).backward()
        total = total + scaled.detach()
    return float(total), batch.epoch


def _share_loss(run: Run, batch: Batch, generator: torch.Generator,
                done: int) -> torch.Tensor | None:
    """This process's loss on its rows of a global batch, weighted so that the average over
    processes is the mean over the whole batch; None when it has no rows."""
    if run.dist.world == 1:
        return batch_loss(run, list(batch.indices), list(batch.flips), generator,
                          list(batch.seeds), done)
    n, rows = len(batch.indices), run.dist.rows(len(batch.indices))
    mine = range(n)[rows]
    if not mine and run.sharded:  # FSDP needs every process in every forward and backward:
        # the batch's first row (another process's), weighted 0, drawing what the others draw.
        loss = batch_loss(run, list(batch.indices[:1]), list(batch.flips[:1]), generator,
                          list(batch.seeds[:1]), done, rows=(slice(0, 1), n))
        return None if loss is None else loss * 0.0
    if not mine:  # draw what the others draw, to keep the noise generator in step
        shape = run.latents.get(batch.indices[0], batch.flips[0], batch.seeds[0]).shape
        run.objective.draw(torch.zeros(n, *shape), generator)
        return None
    loss = batch_loss(run, list(batch.indices[rows]), list(batch.flips[rows]), generator,
                      list(batch.seeds[rows]), done, rows=(rows, n))
    return None if loss is None else loss * (len(mine) * run.dist.world / n)


def _optimizer_step(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                    scaler: torch.amp.GradScaler, params: list[torch.nn.Parameter],
                    max_norm: float | None) -> float:
    """Clip, step, advance the schedule and clear gradients; returns the lr that was used.

    A step without any gradient (no caption used a placeholder that alone trains) applies
    nothing (AdamW skips parameters without a gradient) and counts like any other. The fp16
    loss scaler is not asked then: with no gradient to check for overflow it refuses to step.
    """
    if not scaler.is_enabled() or any(p.grad is not None for p in params):
        if max_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(opt)
        scaler.update()
    lr = step_lr(opt)  # the rate this step used
    sched.step()
    opt.zero_grad(set_to_none=True)
    return lr


def _between_steps(run: Run, hooks: Hooks, state: TrainState, step: int) -> None:
    """Save and sample when due or asked for (request files, requests.py); on a stop request,
    checkpoint and raise `Interrupted`.

    The stop request is read after sampling, which itself ends early when asked to: a
    SIGTERM during a sample event stops after the current image (`sample_events`). Request
    files are read in the same look (rank 0 reads them; one collective tells every process,
    which all save)."""
    cfg = run.cfg
    saved = _save(hooks, state, step) if _due(step, cfg.save.every_n_steps) else None
    sampled = cfg.sample.prompts is not None and _due(step, cfg.sample.every_n_steps)
    if sampled:  # on every process: a stop asked of any of them ends it early
        sample_event(run, hooks, state, step)
    asked = hooks.stop()
    wanted = requests.pending(run.out) if run.dist.main else set()
    stop, want_sample, want_save = run.dist.any_of(
        [asked, requests.SAMPLE in wanted, requests.SAVE in wanted])
    if stop and not asked:
        log.warning("another process of this run was asked to stop: stopping after step %d",
                    step)
    if want_save:
        log.info("save requested (%s): saving at step %d", requests.folder(run.out), step)
        if saved is None:  # a stop saves the checkpoint below; the LoRA file is written here
            saved = _save(hooks, state, step, checkpoint=not stop)
    if want_sample and not stop:  # when stopping, the request waits for the resumed run
        log.info("sample requested (%s): sampling at step %d", requests.folder(run.out), step)
        if hooks.sampler is None and run.dist.main:
            log.warning("sample requested, but this run has no sample.prompts: nothing to "
                        "sample")
        elif not sampled:
            sample_event(run, hooks, state, step)
    done = [k for k, on in ((requests.SAVE, want_save), (requests.SAMPLE, want_sample and not stop))
            if on]
    if done and run.dist.main:
        requests.clear(run.out, done)
    # A stop asked during a requested sample event (every process knows there was one).
    stop = stop or (want_sample and run.dist.any(hooks.stop()))
    if stop:
        saved = saved or hooks.checkpoints.save(state)
        raise Interrupted(step, saved)


def _save(hooks: Hooks, state: TrainState, step: int, checkpoint: bool = True) -> Path | None:
    """The LoRA file of this step and (`checkpoint`) a resume checkpoint; the latter's folder.
    LoRA files are written from the weights to use (schedule-free's x, the EMA); the
    checkpoint holds the training weights."""
    with state.eval_weights(), using(state.ema, "saves"):
        hooks.checkpoints.save_lora(step)
    return hooks.checkpoints.save(state) if checkpoint else None
