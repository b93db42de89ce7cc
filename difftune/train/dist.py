"""Data-parallel training on accelerate's process group.

`accelerate launch -m difftune train CONFIG` (or `difftune train --num-processes N`, which runs
that) starts one process per GPU, or per CPU share for tests. Every process builds the same
model and LoRA from the same seed and walks the same global batch order; each trains on its
rows of every global batch (`train.batch_size` per process), and once per optimizer step the
trainable gradients and the loss are averaged across processes in one all-reduce (what DDP does
with `no_sync` over the accumulation steps). The trainable set of a LoRA run is small (tens of
MB on FLUX.1), and a plain all-reduce keeps working with block swap, text-encoder LoRAs and
embeddings, which DDP's module wrapper does not see.

Noise and timesteps are drawn for the whole global batch on every process and each process
keeps its rows, so N processes with batch B draw what one process with batch N*B draws: the
runs agree up to floating-point summation order, and a checkpoint resumes on any number of
processes that keeps the global batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence, TypeVar

import torch

# launched() lives in the torch-free train/world.py (the CLI asks it first); here for callers.
from difftune.train.world import launched

log = logging.getLogger("difftune")
T = TypeVar("T")
# Rank 0 alone samples between steps while the others wait in the next all-reduce; the default
# NCCL timeout (10 minutes) would kill a run whose sample event takes longer. A rank that fails
# ends its process, and the launcher then stops the others; this is only the last resort.
TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank, number of processes, and the collectives used."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the process that logs, reports, samples and writes files."""
        return self.rank == 0

    @classmethod
    def start(cls, device: torch.device) -> "Dist":
        """Join the process group the launcher set up (one process: nothing to join)."""
        if not launched():
            return cls()
        from accelerate import PartialState

        # cpu=True makes accelerate use gloo on CPU-only runs (tests); CUDA runs get NCCL and
        # one GPU per local rank (torch.cuda.set_device), so "cuda" means this process's GPU.
        state = PartialState(cpu=device.type == "cpu", timeout=TIMEOUT)
        return cls(state.process_index, state.num_processes)

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.world > 1:
            torch.distributed.barrier()

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's contiguous share of `items` (all processes' shares cover them once)."""
        return list(items[self.rows(len(items))])

    def rows(self, n: int) -> slice:
        """This process's rows of a global batch of `n` (may be empty for a short last batch)."""
        return slice(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def average(self, params: Sequence[torch.nn.Parameter], loss: float) -> float:
        """Average the gradients of `params` and `loss` over all processes, in place.

        One flat all-reduce of the gradients, the loss and a has-gradient flag per parameter.
        A parameter without a gradient on some process (its share of a short batch was empty,
        or none of its captions used a placeholder) counts as zeros there; one without a
        gradient on every process keeps none, so the optimizer skips it as it would in one
        process. Returns the averaged loss (non-finite if any process's was). FSDP-sharded
        parameters are left out: their gradients were averaged by FSDP's reduce-scatter.
        """
        if self.world == 1:
            return loss
        params = [p for p in params if not _sharded(p)]
        device = params[0].device if params else self._device()
        flat = [p.grad.reshape(-1).float() if p.grad is not None
                else torch.zeros(p.numel(), device=p.device) for p in params]
        flags = [1.0 if p.grad is not None else 0.0 for p in params]
        buf = torch.cat([t.to(device) for t in flat]
                        + [torch.tensor(flags + [loss], device=device)])
        torch.distributed.all_reduce(buf)
        buf /= self.world
        offset, had = 0, buf[-len(params) - 1: -1].tolist()
        for p, seen in zip(params, had):
            part = buf[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            if seen == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = part.to(p.dtype).clone()
            else:
                p.grad.copy_(part)
        return float(buf[-1])

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any process (all processes must call this together)."""
        return self.any_of([flag])[0]

    def any_of(self, flags: Sequence[bool]) -> list[bool]:
        """For each of `flags`, whether it is true on any process, in one all-reduce (all
        processes call this together with as many flags). A flag only rank 0 can know (a
        request file it read) reaches every process this way: the others pass False."""
        if self.world == 1:
            return list(flags)
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self._device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [v > 0 for v in t.tolist()]

    def broadcast_params(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make every process hold rank 0's values of `params` (they start equal from the seed;
        this makes it a fact, also after a resume). FSDP-sharded parameters are left out:
        each process holds its own piece of them."""
        if self.world == 1:
            return
        with torch.no_grad():
            for p in params:
                if _sharded(p):
                    continue
                torch.distributed.broadcast(p.data, src=0)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process (picklable values only)."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, device=self._device())
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def _device(self) -> torch.device:
        """Where collectives of this backend take their tensors (NCCL: this process's GPU)."""
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _sharded(t: torch.Tensor) -> bool:
    """Whether `t` is an FSDP-sharded parameter (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


_current = Dist()


def current() -> Dist:
    """The process's `Dist` (single-process until `init` ran in a launched process)."""
    return _current


def init(device: torch.device) -> Dist:
    """Join the launcher's process group once; later calls return the same `Dist`."""
    global _current
    if _current.world == 1:
        _current = Dist.start(device)
    return _current
