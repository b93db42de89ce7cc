"""What a checkpoint folder must hold, checked before any of it is used.

A checkpoint is read from files a user can edit, copy half-way or damage. Every field the
resume uses is checked here first (its type, and each tensor's dtype and shape against the
others in the folder), so a damaged checkpoint is refused with the file and the field named,
instead of failing with a KeyError or a shape error half-way through putting weights back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from difftune.errors import CheckpointError
from difftune.train.state import SEP

# Optimizer state entries that hold one value per weight (torch's AdamW and SGD names): each
# must have its parameter's shape. Other entries (8-bit optimizers' quantization maps) are
# checked by the optimizer that reads them.
PER_WEIGHT = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Sampler(_Open):
    epoch: StrictInt = Field(ge=0)
    position: StrictInt = Field(ge=0)
    seed: StrictInt
    batch_size: StrictInt = Field(ge=1)
    num_items: StrictInt = Field(ge=1)
    fingerprint: str


class _Identity(_Open):
    family: str
    adapter: str
    rank: StrictInt = Field(ge=1)
    alpha: float
    targets: list[str]
    text_encoders: list[str]
    embeddings: list[dict[str, Any]]


class _Rng(_Open):
    python: tuple[StrictInt, list[StrictInt], float | None]
    numpy: tuple[str, list[StrictInt], StrictInt, StrictInt, float]


class _Scheduler(_Open):
    last_epoch: StrictInt
    base_lrs: list[float]


class _Doc(_Open):
    step: StrictInt = Field(ge=1)
    sampler: _Sampler
    counters: dict[str, float] = Field(default_factory=dict)
    optimizer: list[dict[str, Any]]
    scheduler: _Scheduler
    scaler: dict[str, Any]
    rng: _Rng
    identity: _Identity
    config: dict[str, Any]


def check_doc(doc: object, where: Path) -> None:
    """Refuse a `state.json` that is not an object or lacks (or mistypes) a field."""
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where} holds {type(doc).__name__}, not a checkpoint's state "
                              "object; the checkpoint is damaged: resume from another one")
    try:
        _Doc.model_validate(doc)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: "
                             f"{e['msg'].lower()}" for e in err.errors()[:6])
        raise CheckpointError(f"{where} is damaged ({problems}); resume from another "
                              "checkpoint (--resume PATH) or start a new run") from None


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is damaged: {what}; resume from another checkpoint "
                           "(--resume PATH) or start a new run")


def check_rng(rng: dict[str, torch.Tensor], path: Path) -> None:
    """The saved torch generator states must be byte tensors of the size torch uses."""
    size = torch.get_rng_state().shape
    for name in ("torch_cpu", "generator"):
        value = rng.get(name)
        if value is None:
            raise _refuse(path, f"no {name!r} state")
        if value.dtype != torch.uint8 or value.shape != size:
            raise _refuse(path, f"{name!r} is {value.dtype} {tuple(value.shape)}, expected "
                          f"uint8 {tuple(size)}")


def check_trainable(trainable: Mapping[str, torch.Tensor], rank: int, path: Path) -> None:
    """Each LoRA factor is a floating matrix whose rank side is the adapter's rank."""
    for name, value in trainable.items():
        if not value.is_floating_point():
            raise _refuse(path, f"{name} is {value.dtype}, not floating point")
        side = 0 if name.endswith("lora_A.weight") else 1 if name.endswith("lora_B.weight") else None
        if side is not None and (value.ndim != 2 or value.shape[side] != rank):
            raise _refuse(path, f"{name} has shape {tuple(value.shape)}, which does not fit "
                          f"rank {rank}")


def check_optimizer(tensors: Mapping[str, torch.Tensor], trainable: Mapping[str, torch.Tensor],
                    path: Path) -> None:
    """Every optimizer entry belongs to a trained weight; per-weight moments have its shape."""
    for key, value in tensors.items():
        name, _, item = key.rpartition(SEP)
        if name not in trainable:
            raise _refuse(path, f"{key} belongs to no trained weight of the checkpoint")
        if item in PER_WEIGHT and value.shape != trainable[name].shape:
            raise _refuse(path, f"{key} has shape {tuple(value.shape)}, its weight "
                          f"{tuple(trainable[name].shape)}")
        if item == "step" and value.numel() != 1:
            raise _refuse(path, f"{key} holds {value.numel()} values, not one step count")


def check_ema(ema: Mapping[str, torch.Tensor], trainable: Mapping[str, torch.Tensor],
              path: Path) -> None:
    """Every EMA tensor averages a trained weight of the checkpoint, with its shape."""
    for name, value in ema.items():
        if name not in trainable or value.shape != trainable[name].shape:
            raise _refuse(path, f"{name} averages no trained weight of the checkpoint of "
                          f"shape {tuple(value.shape)}")


def check_against_run(trainable: Mapping[str, torch.Tensor],
                      params: dict[str, torch.nn.Parameter],
                      path: Path) -> None:
    """The checkpoint's weights are the run's trained weights, name for name and shape for
    shape; checked before the first one is copied in."""
    if set(params) != set(trainable):
        extra = sorted(set(trainable) - set(params))[:3]
        lacking = sorted(set(params) - set(trainable))[:3]
        raise CheckpointError(f"checkpoint {path.parent} holds other trained weights than this "
                              f"run (only in the checkpoint: {extra}; only in the run: "
                              f"{lacking}); resume with the checkpoint's adapter settings")
    for name, value in trainable.items():
        if value.shape != params[name].shape:
            raise _refuse(path, f"{name} has shape {tuple(value.shape)}, the run's weight "
                          f"{tuple(params[name].shape)} (a model of another size?)")
