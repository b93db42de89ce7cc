"""A checkpoint folder on disk: its files, finding it, reading it safely, writing it atomically.

Folder layout (`checkpoints/step-000123/`):
- `trainable.safetensors`: the trained weights (fp32) by canonical name (the diffusers LoRA
  key, or the module's own parameter name for a full fine-tune; never a position or a peft /
  quantizer internal name);
- `optimizer.safetensors`: each parameter's optimizer state as `<name>::<key>`;
  both written shard by shard when large (`trainable-00001-of-00004.safetensors`... and
  `trainable.safetensors.index.json`, see files/shards.py), so a save of a full fine-tune
  never holds a second copy of the model or of the optimizer state in host memory;
- with `train.distributed = "fsdp"` the two (and the EMA) are one folder `sharded/` instead,
  written by every process through torch's distributed checkpoint (train/sharding.py):
  safetensors files, one per process, each holding that process's pieces; read back on any
  number of processes;
- `ema.safetensors` (with `train.ema`): the moving average of the trained weights by
  canonical name, sharded like them;
- `rng.safetensors`: torch CPU, each CUDA device, and the run's noise generator;
- `state.json`: step, sampler position, optimizer groups, LR schedule, loss scaler, python and
  numpy RNG, counters, identity of the adapter, resolved config, versions; written last, so a
  folder without it is an interrupted save;
- the LoRA in the configured format.

`--resume latest|PATH` picks a complete checkpoint folder (an interrupted save has no
state.json and is never picked). Only safetensors and JSON are read: a pickle-based file is
refused before anything opens it, so loading a checkpoint never runs code.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from difftune import __version__
from difftune.adapters.formats import write_safetensors
from difftune.errors import CheckpointError
from difftune.files.names import COMFYUI_DORA
from difftune.files.safe import is_pickle, pickle_refusal
from difftune.files.shards import SHARD_BYTES, exists, meta, read_sharded, write_sharded
from difftune.train import sharding
from difftune.train.checkpoint.check import (check_doc, check_ema, check_optimizer, check_rng,
                                             check_trainable)

CHECKPOINT_FORMAT = 1
FILES = ("trainable.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")
EMA_FILE = "ema.safetensors"


@dataclass
class Checkpoint:
    """A checkpoint folder's contents, read without running any code."""

    path: Path
    doc: dict[str, Any]
    # Weights, optimizer state and EMA are read lazily, one tensor at a time (LazyTensors).
    trainable: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    ema: Mapping[str, torch.Tensor] | None = None
    # The `sharded/` folder of an FSDP run's checkpoint: `trainable` and `optimizer` then hold
    # meta tensors (shapes and dtypes only), and the manager reads the values with DCP.
    sharded: Path | None = None

    @property
    def step(self) -> int:
        """The optimizer step the checkpoint was taken after."""
        return int(self.doc["step"])

    def release(self) -> None:
        """Let go of the lazily read files once their tensors are put back (an open file
        of a checkpoint that `save.keep_last` prunes would keep its disk space)."""
        self.trainable, self.optimizer, self.ema = {}, {}, None

    def train_state(self) -> dict[str, Any]:
        """The saved state in the shape `TrainState.load_state_dict` takes."""
        doc = self.doc
        return {"step": doc["step"], "sampler": doc["sampler"],
                "counters": doc.get("counters", {}),
                "optimizer": {"groups": doc["optimizer"], "tensors": self.optimizer},
                "scheduler": doc["scheduler"], "scaler": doc["scaler"],
                "rng": {"tensors": self.rng, "plain": doc["rng"]},
                "ema": None if self.ema is None else {"tensors": self.ema,
                                                      "plain": doc.get("ema") or {}},
                "validation": doc.get("validation") or {}}


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders with a complete state.json, oldest first (by step)."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


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
        sharded = path / sharding.FOLDER if (path / sharding.FOLDER).is_dir() else None
        if sharded is not None:
            trainable, optimizer, averaged = sharding.shapes(sharded)
            ema = averaged or None
        else:
            trainable, optimizer = (read_sharded(path / name) for name in FILES[:2])
            ema = read_sharded(path / EMA_FILE) if exists(path / EMA_FILE) else None
        rng = load_file(str(path / FILES[2]))
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
                              "it is damaged or not a difftune checkpoint") from None
    check_rng(rng, path / FILES[2])
    # Shapes and dtypes from the headers: nothing of the weights is read yet.
    weights = meta(trainable)
    check_trainable(weights, int(doc["identity"]["rank"]), path / FILES[0])
    check_optimizer(meta(optimizer), weights, path / FILES[1])
    check_ema(meta(ema or {}), weights, path / EMA_FILE)
    return Checkpoint(path, doc, trainable, optimizer, rng, ema, sharded)


def lora_file(folder: Path) -> Path:
    """The LoRA file a checkpoint folder holds beside its state files (and not a DoRA run's
    ComfyUI file, `<name>-comfyui.safetensors`, which is for ComfyUI alone)."""
    ours = (*FILES, EMA_FILE)
    found = [p for p in sorted(folder.glob("*.safetensors")) if p.name not in ours
             and not p.name.startswith(tuple(n.removesuffix(".safetensors") + "-"
                                             for n in ours))
             and not p.stem.endswith(COMFYUI_DORA)]
    return found[0] if found else folder


def versions() -> dict[str, str]:
    """Library versions recorded with a checkpoint."""
    import diffusers
    import peft
    import transformers

    return {"difftune": __version__, "torch": torch.__version__,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__}


def fsync(path: Path) -> None:
    """Flush a file's or folder's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file (with the mode the umask gives), synced to disk."""
    write_safetensors(path, tensors)
    fsync(path)


def write_big(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
              max_bytes: int = SHARD_BYTES) -> None:
    """A tensor set that may be large (weights, optimizer state), written shard by shard
    (each cast to `dtype` and moved to the host on its own), every file synced to disk."""
    write_sharded(path, tensors, dtype, max_bytes, after=fsync)


def write_text(path: Path, text: str) -> None:
    """A UTF-8 text file, synced to disk."""
    path.write_text(text, encoding="utf-8")
    fsync(path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished temporary folder into place (replacing a same-step checkpoint)."""
    fsync(tmp)
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync(final.parent)
