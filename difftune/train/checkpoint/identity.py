"""What a resumed run must share with its checkpoint, built in one function, checked in one.

A checkpoint made for another adapter (family, rank, alpha, targets, trained text encoders,
embeddings) is refused with every difference named, before the run writes anything; so is one
whose data or global batch changed (its saved position would name other batches). A changed
learning rate or step count is allowed with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from difftune.config import RunConfig
from difftune.data.discover import DataSet
from difftune.data.sampler import BucketBatchSampler
from difftune.errors import CheckpointError
from difftune.train.checkpoint.files import Checkpoint, lora_file
from difftune.train.dist import current

log = logging.getLogger("difftune")


def resume_identity(cfg: RunConfig, targets: list[str] | None = None) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (else the weights mean nothing).

    `targets` (the LoRA's module names) are known once the model has loaded; before that
    (None) the identity leaves them out, so an incompatible resume can fail in seconds.
    """
    a = cfg.adapter
    out: dict[str, Any] = {"family": cfg.model.family, "adapter": a.type, "rank": a.rank,
                           "alpha": a.scale_alpha}
    if targets is not None:
        out["targets"] = sorted(targets)
    if a.type == "full":
        out["train_blocks"] = a.train_blocks
    return out | {"text_encoders": sorted(a.text_encoders),
                  "embeddings": [e.model_dump(mode="json") for e in a.embeddings]}


def check_compatible(ckpt: Checkpoint, now: dict[str, Any], cfg: RunConfig) -> None:
    """Refuse a resume whose adapter differs (naming each difference); warn about lr/steps.

    `now` is `resume_identity(cfg)` before the model loads (fail fast), then with the
    resolved targets once it has; both before anything is written.
    """
    saved = ckpt.doc["identity"]
    diffs = [f"{key}: checkpoint {saved.get(key)!r}, config {value!r}"
             for key, value in now.items() if saved.get(key) != value]
    if diffs:
        raise CheckpointError(f"cannot resume from {ckpt.path}: the adapter differs ("
                              + "; ".join(diffs) + "). Resume with the checkpoint's settings, "
                              "or start a new run (--init-lora keeps its weights)")
    _check_global_batch(ckpt, cfg)
    if cfg.train.ema.enabled and ckpt.ema is None:
        raise CheckpointError(f"cannot resume from {ckpt.path} with train.ema.enabled: the "
                              "checkpoint holds no EMA (its run had train.ema off); resume "
                              "with train.ema.enabled = false, or start a new run")
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
            f"new run from its weights with --init-lora {lora_file(ckpt.path)}")


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
