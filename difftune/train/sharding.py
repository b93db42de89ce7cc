"""Sharded data-parallel training (`train.distributed = "fsdp"`) for full fine-tunes.

A full fine-tune of a 12-32B denoiser does not fit data-parallel: every process would hold the
fp32 master weights, their gradients and two AdamW moments (16 bytes a weight, 190 GB for
12B). FSDP2 (`torch.distributed.fsdp.fully_shard`) keeps 1/N of each on each of N processes and
gathers one block's weights at a time for its forward and backward.

Why torch's `fully_shard` and not accelerate's FSDP plugin: difftune uses accelerate for its
launcher and process group only (`PartialState`, see dist.py), never its `Accelerator` (the
loop owns autocast, loss scaling, clipping and the optimizer). accelerate's FSDP2 path
(`FullyShardedDataParallelPlugin(fsdp_version=2)`) is reached only through
`Accelerator.prepare`, and accelerate never selects FSDP for a CPU process group (its
`DistributedType.FSDP` is set only for GPU-like backends), so the CPU/gloo tests could not run
it. `fully_shard` is the very function accelerate's plugin calls, used here inside the process
group accelerate launched.

What is sharded: each block of the denoiser the family declares (`FamilySpec.compile_blocks`,
the repeated units block swap and torch.compile also work on), then the root (the rest: embedders,
norms, output projection). With a low-precision compute dtype the blocks' weights are
gathered in it (`MixedPrecisionPolicy(param_dtype)`, which also lets trained fp32 and frozen
bf16 weights share a block) and gradients are reduced in fp32.

Every process must join every forward and backward (each gathers and reduces with the
others), so the loop (loop.py) gives a process without rows in a short last batch another
process's row weighted 0, and backpropagates a non-finite loss rather than leaving the backward
out (the non-finite guard then drops the step's gradients on every process). Over accumulated
micro-batches the gradients are reduce-scattered after each backward and summed sharded (no
process ever holds a whole gradient), and gradient clipping takes the norm of the whole
sharded gradient (`clip_grad_norm_` sums the shards' squares over the processes).

Checkpoints: the trained weights, the optimizer state and the EMA (`train.ema`, whose
diffusers EMAModel clones the sharded weights, so it is sharded alike) are written with
`torch.distributed.checkpoint` (DCP) through its safetensors storage (`HuggingFaceStorageWriter`,
one `shard-0000R-...safetensors` per rank holding that rank's pieces, with their offsets in the
file's metadata), so a checkpoint is still only safetensors and JSON (no pickle), and DCP
re-shards on load: a checkpoint of N processes resumes on M (on one with no process group).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Sequence

import torch

log = logging.getLogger("difftune")

FOLDER = "sharded"  # the DCP folder inside a checkpoint folder
WEIGHTS, OPTIMIZER, EMA = "trainable/", "optimizer/", "ema/"  # key prefixes inside it
Tensors = dict[str, torch.Tensor]


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP-sharded parameter, or its gradient or state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def module_sharded(module: torch.nn.Module) -> bool:
    """Whether `module` was sharded with `shard`."""
    return any(is_sharded(p) for p in module.parameters())


def plain(params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters FSDP does not own (their gradients are averaged by hand, dist.py)."""
    return [p for p in params if not is_sharded(p)]


def shard(denoiser: torch.nn.Module, blocks: Sequence[torch.nn.Module],
          device: torch.device, compute: torch.dtype | None) -> None:
    """Shard `denoiser` across the process group: each of `blocks`, then the root; weights on
    the host are moved to `device` shard by shard (so a process never holds the whole model on
    the accelerator). `compute`: the dtype weights are gathered in (None: their own)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(denoiser, mesh=mesh, mp_policy=policy)
    log.info("FSDP: the denoiser is sharded over %d processes (%d blocks and the root)",
             dist.get_world_size(), len(blocks))


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()`; for a sharded module the whole weights gathered tensor by tensor
    into rank 0's host memory (every process must call it; the others get {})."""
    if not module_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def save(folder: Path, weights: Mapping[str, torch.Tensor],
         optimizer: Mapping[str, torch.Tensor], ema: Mapping[str, torch.Tensor]) -> None:
    """Write the trained weights, optimizer state and EMA (by canonical name) into `folder`,
    every process its own pieces (collective; one process: everything)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors = {WEIGHTS + k: v.detach() for k, v in weights.items()}
    tensors |= {OPTIMIZER + k: v for k, v in optimizer.items()}
    tensors |= {EMA + k: v for k, v in ema.items()}
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def shapes(folder: Path) -> tuple[Tensors, Tensors, Tensors]:
    """What `save` wrote, as meta tensors (shape and dtype, no data): (weights, optimizer,
    EMA). Reads the safetensors headers only."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    out: tuple[Tensors, Tensors, Tensors] = ({}, {}, {})
    for key, item in meta.items():
        i = next(i for i, p in enumerate((WEIGHTS, OPTIMIZER, EMA)) if key.startswith(p))
        name = key.split("/", 1)[1]
        out[i][name] = torch.empty(item.size, dtype=item.properties.dtype, device="meta")
    return out


def load(folder: Path, params: Mapping[str, torch.nn.Parameter],
         optimizer: Mapping[str, torch.Tensor], ema: Mapping[str, torch.Tensor]
         ) -> tuple[Tensors, Tensors]:
    """Read the weights into `params` (in place, each process its own shard: DCP re-shards)
    and return the optimizer state and the EMA by key, shaped like `optimizer` and `ema`
    (`shapes`' meta tensors): a tensor of its weight's shape is laid out like the weight
    (sharded alike), any other is whole. Collective in a multi-process run; one process reads
    without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from difftune.train.state import SEP

    def like(name: str, saved: torch.Tensor) -> torch.Tensor:
        weight = params[name].detach()
        return (torch.zeros_like(weight, dtype=saved.dtype)
                if saved.shape == weight.shape and saved.dim() > 0
                else torch.zeros(saved.shape, dtype=saved.dtype))

    tensors: Tensors = {WEIGHTS + k: p.detach() for k, p in params.items()}
    tensors |= {OPTIMIZER + k: like(k.rpartition(SEP)[0], v) for k, v in optimizer.items()}
    tensors |= {EMA + k: like(k, v) for k, v in ema.items()}
    with torch.no_grad():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)))
    return ({k.removeprefix(OPTIMIZER): v for k, v in tensors.items() if k.startswith(OPTIMIZER)},
            {k.removeprefix(EMA): v for k, v in tensors.items() if k.startswith(EMA)})
