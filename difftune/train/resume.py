"""Reading a checkpoint back: finding it, refusing what is unsafe or incompatible, restoring.

`--resume latest|PATH` picks a complete checkpoint folder (an interrupted save has no
state.json and is never picked). Only safetensors and JSON are read: a pickle-based file is
refused before anything opens it. A checkpoint made for another adapter (family, rank, alpha,
targets, trained text encoders) is refused with every difference named, before the run writes
anything; a changed learning rate or step count is allowed with a warning.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from difftune.config import RunConfig
from difftune.errors import CheckpointError
from difftune.safefiles import is_pickle, pickle_refusal
from difftune.train.dist import current
from difftune.data.discover import DataSet
from difftune.data.sampler import BucketBatchSampler
from difftune.train.checkpoint import CHECKPOINT_FORMAT, CheckpointManager, complete_checkpoints
from difftune.train.ckpt_check import (check_against_run, check_doc, check_optimizer, check_rng,
                                       check_trainable)
from difftune.train.optim import lr_factor
from difftune.train.state import TrainState, load_optimizer, set_rng_state

log = logging.getLogger("difftune")
FILES = ("trainable.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")


@dataclass
class Checkpoint:
    """A checkpoint folder's contents, read without running any code."""

    path: Path
    doc: dict[str, Any]
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        """The optimizer step the checkpoint was taken after."""
        return int(self.doc["step"])


def find(out: Path, which: str) -> Path:
    """The folder `--resume` names: "latest" in `out`, or a path."""
    if which == "latest":
        found = complete_checkpoints(out / "checkpoints")
        if not found:
            raise CheckpointError(f"--resume latest: no complete checkpoint in {out / 'checkpoints'}"
                                  "; start without --resume, or give a checkpoint folder")
        return found[-1]
    path = Path(which).expanduser()
    if is_pickle(path):
        raise CheckpointError(pickle_refusal(path))
    if not (path / "state.json").is_file():
        raise CheckpointError(f"--resume {path}: not a complete difftune checkpoint folder (no "
                              "state.json: an interrupted save, or another file); use latest")
    return path


def read(path: Path) -> Checkpoint:
    """Load a checkpoint folder: safetensors and JSON only; pickles are refused unopened."""
    for item in path.iterdir():
        if is_pickle(item):
            raise CheckpointError(f"checkpoint {path} holds {item.name}: " + pickle_refusal(item))
    try:
        doc = json.loads((path / "state.json").read_text(encoding="utf-8"))
        if isinstance(doc, dict) and (doc.get("format") != CHECKPOINT_FORMAT
                                      or not doc.get("complete")):
            raise CheckpointError(f"checkpoint {path} has format {doc.get('format')!r}; this "
                                  f"difftune reads format {CHECKPOINT_FORMAT}")
        check_doc(doc, path / "state.json")
        trainable, optimizer, rng = (load_file(str(path / name)) for name in FILES[:3])
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
                              "it is damaged or not a difftune checkpoint") from None
    check_rng(rng, path / FILES[2])
    check_trainable(trainable, int(doc["identity"]["rank"]), path / FILES[0])
    check_optimizer(optimizer, trainable, path / FILES[1])
    return Checkpoint(path, doc, trainable, optimizer, rng)


def config_identity(cfg: RunConfig) -> dict[str, Any]:
    """The part of `CheckpointManager.identity` known before the model loads (no targets)."""
    a = cfg.adapter
    return {"family": cfg.model.family, "adapter": a.type, "rank": a.rank,
            "alpha": a.scale_alpha, "text_encoders": sorted(a.text_encoders),
            "embeddings": [e.model_dump(mode="json") for e in a.embeddings]}


def check_compatible(ckpt: Checkpoint, now: dict[str, Any], cfg: RunConfig) -> None:
    """Refuse a resume whose adapter differs (naming each difference); warn about lr/steps.

    `now` is `config_identity(cfg)` before the model loads (fail fast), then
    `CheckpointManager.identity()` once the targets are resolved; both before anything is written.
    """
    saved = ckpt.doc["identity"]
    diffs = [f"{key}: checkpoint {saved.get(key)!r}, config {value!r}"
             for key, value in now.items() if saved.get(key) != value]
    if diffs:
        raise CheckpointError(f"cannot resume from {ckpt.path}: the adapter differs ("
                              + "; ".join(diffs) + "). Resume with the checkpoint's settings, "
                              "or start a new run (--init-lora keeps its weights)")
    _check_global_batch(ckpt, cfg)
    old = ckpt.doc["config"]["train"]
    for key in ("lr", "steps"):
        if old.get(key) != getattr(cfg.train, key):
            log.warning("resuming with train.%s = %s (the checkpoint's run had %s)", key,
                        getattr(cfg.train, key), old.get(key))
    if ckpt.step >= cfg.train.steps:
        raise CheckpointError(f"checkpoint {ckpt.path} is at step {ckpt.step}, and train.steps "
                              f"is {cfg.train.steps}: nothing left to train; raise train.steps")


def check_data(ckpt: Checkpoint, data: DataSet, global_batch: int, seed: int) -> None:
    """Refuse a resume whose datasets changed since the checkpoint (images added, removed,
    renamed, re-bucketed or repeated otherwise): its saved position would name other batches.
    Runs on the scanned data, before the model loads and the caches fill."""
    saved = ckpt.doc["sampler"]
    now = BucketBatchSampler(data, global_batch, seed).identity()
    if saved.get("num_items") != now["num_items"] or saved.get("fingerprint") != now["fingerprint"]:
        raise CheckpointError(
            f"cannot resume from {ckpt.path}: the datasets changed since it was saved "
            f"({saved.get('num_items')} items then, {now['num_items']} now, or other file "
            "names, buckets or repeats); resume with the datasets as they were, or start a "
            f"new run from its weights with --init-lora {_lora_file(ckpt.path)}")


def _lora_file(folder: Path) -> Path:
    """The LoRA file a checkpoint folder holds beside its state files."""
    found = [p for p in sorted(folder.glob("*.safetensors")) if p.name not in FILES]
    return found[0] if found else folder


def _check_global_batch(ckpt: Checkpoint, cfg: RunConfig) -> None:
    """The data order is planned in global batches (train.batch_size x processes): a resume
    on another number of processes continues exactly when the global batch is kept."""
    saved, world = int(ckpt.doc["sampler"]["batch_size"]), current().world
    now = cfg.train.batch_size * world
    if saved == now:
        return
    fix = (f"set train.batch_size = {saved // world} with {world} process(es)"
           if saved % world == 0 else f"use a number of processes that divides {saved}")
    raise CheckpointError(
        f"cannot resume from {ckpt.path}: its global batch is {saved} and this run's is {now} "
        f"(train.batch_size {cfg.train.batch_size} x {world} process(es)); the data order "
        f"continues exactly only with the same global batch: {fix}")


def restore(ckpt: Checkpoint, manager: CheckpointManager, cfg: RunConfig,
            opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
            scaler: torch.amp.GradScaler, generator: torch.Generator) -> TrainState:
    """Put weights, optimizer, schedule, scaler and RNGs back; returns where to go on from."""
    params = manager.trainable()
    check_against_run(ckpt.trainable, params, ckpt.path / FILES[0])
    with torch.no_grad():
        for name, value in ckpt.trainable.items():
            params[name].copy_(value)
    names = {id(p): n for n, p in params.items()}
    configured = [g["initial_lr"] for g in opt.param_groups]  # this config's peak rates
    load_optimizer(opt, names, ckpt.doc["optimizer"], ckpt.optimizer)
    sched.load_state_dict(ckpt.doc["scheduler"])
    _configured_rates(opt, sched, configured, cfg)
    if ckpt.doc["scaler"]:
        scaler.load_state_dict(ckpt.doc["scaler"])
    set_rng_state(generator, ckpt.rng, ckpt.doc["rng"])
    return TrainState(ckpt.step, ckpt.doc["sampler"], ckpt.doc.get("counters", {}))


def _configured_rates(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                      configured: list[float], cfg: RunConfig) -> None:
    """This config's peak rates and schedule govern from the next step on: a changed lr (any
    group's), step count or schedule takes effect; an unchanged config recomputes the very
    values the checkpoint holds (the same formula as the scheduler's)."""
    sched.base_lrs = list(configured)
    factor = lr_factor(sched.last_epoch, cfg.train)
    for group, base in zip(opt.param_groups, configured):
        group["initial_lr"] = base
        group["lr"] = base * factor
