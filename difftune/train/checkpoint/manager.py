"""The one checkpoint manager: save, find, load, compatibility and pruning of resume checkpoints.

A checkpoint (`checkpoints/step-NNNNNN/`, see `files.py` for its contents) is written into a
temporary folder, synced, and renamed into place, so an interrupted save is never taken for the
latest; `save.keep_last` prunes old ones. The loop hands `save` one `TrainState`, which knows
its own state; the manager adds the trained weights (by canonical name), the identity of the
adapter, the resolved config and the library versions.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from difftune.config import RunConfig
from difftune.data.discover import DataSet
from difftune.errors import CheckpointError
from difftune.files.shards import meta
from difftune.files.space import writing
from difftune.train.checkpoint import files
from difftune.train.checkpoint.check import check_against_run
from difftune.train.checkpoint.files import CHECKPOINT_FORMAT, FILES, Checkpoint
from difftune.train.checkpoint.identity import check_compatible, check_data, resume_identity
from difftune.train.checkpoint.lora import FIX, LoraFiles
from difftune.train import sharding
from difftune.train.dist import current
from difftune.train.state import TrainState

log = logging.getLogger("difftune")


class CheckpointManager(LoraFiles):
    """Writes the LoRA files (see `LoraFiles`) and owns the resume checkpoints.

    With `writes` False (every process but rank 0 of a multi-process run, whose trained
    weights are the same) the save methods return the paths rank 0 writes and write nothing.
    `open` and `check_data` need no model: they run before it loads, so a resume that cannot
    work fails in seconds.
    """

    @classmethod
    def open(cls, cfg: RunConfig, which: str) -> Checkpoint:
        """The checkpoint `--resume which` names in cfg.save.dir ("latest" or a folder), read
        and checked against what the config alone says of the adapter."""
        ckpt = files.read(files.find(cfg.save.dir, which))
        check_compatible(ckpt, resume_identity(cfg), cfg)
        if ckpt.sharded is None and cfg.train.distributed == "fsdp" and current().world > 1:
            raise CheckpointError(f"checkpoint {ckpt.path} was written by a train.distributed = "
                                  "\"ddp\" run, and a sharded run on several processes resumes "
                                  "only sharded checkpoints: resume it with train.distributed = "
                                  "\"ddp\", or on one process (whose checkpoints are sharded)")
        return ckpt

    @staticmethod
    def check_data(ckpt: Checkpoint, data: DataSet, global_batch: int, seed: int) -> None:
        """Refuse a resume whose scanned datasets differ from the checkpoint's."""
        check_data(ckpt, data, global_batch, seed)

    shard_bytes = files.SHARD_BYTES  # the largest shard of trainable/optimizer files

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint (else the weights mean nothing)."""
        return resume_identity(self.cfg, self.targets)

    def check_compatible(self, ckpt: Checkpoint) -> None:
        """Refuse `ckpt` when the loaded adapter (its targets included) differs from it."""
        check_compatible(ckpt, self.identity(), self.cfg)

    def names(self) -> dict[int, str]:
        """id(param) -> canonical name, for every trained parameter."""
        return {id(p): n for n, p in self.trainable().items()}

    def save(self, state: TrainState) -> Path:
        """Everything an exact resume needs, written atomically; returns the folder. A failed
        write (a full disk) removes the half-written folder and raises `EnvironmentProblem`;
        earlier checkpoints stay as they were."""
        root = self.out / "checkpoints"
        final = root / f"step-{state.step:06d}"
        if self.sharded:  # every process writes its pieces into rank 0's temporary folder
            return self._save_sharded(root, final, state)
        if not self.writes:
            return final
        tmp = root / f".tmp-step-{state.step:06d}-{os.getpid()}"
        try:
            with writing(root, f"checkpoint {final.name}", self.bytes_needed(), FIX):
                self._write(tmp, final, state)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone when renamed; a failure's remains
        self.prune()
        log.info("saved checkpoint %s", final)
        return final

    @property
    def sharded(self) -> bool:
        """Whether checkpoints hold the weights and optimizer state as a DCP folder written by
        every process (train.distributed = "fsdp", also in one process: any count resumes)."""
        return self.cfg.train.distributed == "fsdp"

    def _save_sharded(self, root: Path, final: Path, state: TrainState) -> Path:
        """`save` of an FSDP run: rank 0 makes the temporary folder, every process writes its
        pieces of the weights and optimizer state into it, rank 0 adds the rest and renames
        it into place; every process returns once the folder is complete."""
        dist = current()
        tmp = root / f".tmp-step-{state.step:06d}-{dist.broadcast(os.getpid())}"
        try:
            if self.writes:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier()
            saved = state.state_dict()
            ema = saved["ema"]["tensors"] if saved["ema"] is not None else {}
            sharding.save(tmp / sharding.FOLDER, self.trainable(), saved["optimizer"]["tensors"],
                          ema)
            if self.writes:
                with writing(root, f"checkpoint {final.name}", self.bytes_needed(), FIX):
                    self._write(tmp, final, state, saved)
        finally:
            if self.writes:
                shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        if self.writes:
            self.prune()
            log.info("saved checkpoint %s", final)
        return final

    def _write(self, tmp: Path, final: Path, state: TrainState,
               saved: dict[str, Any] | None = None) -> None:
        """The checkpoint's files into `tmp`, then `tmp` renamed to `final` (`saved`: the
        state's `state_dict()` whose weights, optimizer tensors and EMA are already in `tmp`)."""
        own = saved is None
        if saved is None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            saved = state.state_dict()
            # Shard by shard: each shard is cast and copied to the host only while written.
            files.write_big(tmp / FILES[0], self.trainable(), torch.float32, self.shard_bytes)
            files.write_big(tmp / FILES[1], saved["optimizer"]["tensors"], None,
                            self.shard_bytes)
        files.write_tensors(tmp / FILES[2], saved["rng"]["tensors"])
        if saved["ema"] is not None and own:
            files.write_big(tmp / files.EMA_FILE, saved["ema"]["tensors"], torch.float32,
                            self.shard_bytes)
        # The training weights (schedule-free: its y, with z in the optimizer state); the LoRA
        # file holds the weights to use (a full fine-tune's weights are trainable.* alone).
        if self.cfg.adapter.type != "full":
            with state.eval_weights():
                self.save_lora(state.step, path=tmp / f"{self.cfg.save.name}.safetensors")
        doc = {"format": CHECKPOINT_FORMAT, "complete": True, "step": saved["step"],
               "sampler": saved["sampler"], "counters": saved["counters"],
               "optimizer": saved["optimizer"]["groups"], "scheduler": saved["scheduler"],
               "scaler": saved["scaler"], "rng": saved["rng"]["plain"],
               "ema": saved["ema"]["plain"] if saved["ema"] is not None else None,
               "validation": saved["validation"],
               "identity": self.identity(), "config": self.cfg.model_dump(mode="json"),
               "versions": files.versions()}
        files.write_text(tmp / FILES[3], json.dumps(doc, indent=1))  # last: marks it complete
        files.replace_dir(tmp, final)

    def load(self, ckpt: Checkpoint, state: TrainState) -> None:
        """Put the checkpoint's weights into the model and the rest into `state` (optimizer,
        schedule, scaler, RNGs, sampler position, counters, step)."""
        params = self.trainable()
        check_against_run(meta(ckpt.trainable), params, ckpt.path / FILES[0])
        saved = ckpt.train_state()
        if ckpt.sharded is not None:  # DCP: each process reads its pieces, on any count
            saved["optimizer"]["tensors"], ema = sharding.load(ckpt.sharded, params,
                                                               ckpt.optimizer, ckpt.ema or {})
            if saved["ema"] is not None:
                saved["ema"]["tensors"] = ema
        else:  # (`open` refused a ddp checkpoint for a sharded model)
            with torch.no_grad():
                for name, value in ckpt.trainable.items():
                    params[name].copy_(value)
        state.load_state_dict(saved)
        ckpt.release()

    def prune(self) -> None:
        """Keep the `save.keep_last` newest complete checkpoints."""
        keep = self.cfg.save.keep_last
        if keep is None:
            return
        for old in files.complete_checkpoints(self.out / "checkpoints")[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
