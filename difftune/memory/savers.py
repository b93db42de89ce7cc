"""The memory savers a run turns on: block swap, torch.compile of the blocks, and the checks
that refuse combinations which cannot work, before the model loads.

Gradient checkpointing is the denoiser's own (diffusers `enable_gradient_checkpointing`), the
8-bit optimizer and the fused backward pass live with the optimizers (train/optimizers/).
"""

from __future__ import annotations

import logging

import torch

from difftune.config import RunConfig
from difftune.config.checks import cuda_only, no_swap
from difftune.errors import ConfigError, EnvironmentProblem
from difftune.families.base import Family, blocks_of
from difftune.memory.blockswap import BlockSwap
from difftune.train.optimizers.specs import OPTIMIZERS

log = logging.getLogger("difftune")


def check(cfg: RunConfig, family: Family, device: torch.device, world: int) -> None:
    """Refuse savers this device, family or process count cannot run (fail in seconds)."""
    t = cfg.train
    spec = OPTIMIZERS[t.optimizer]
    if spec.cuda_only:
        if device.type != "cuda":
            raise ConfigError(cuda_only(t.optimizer) + f" (this run's device is {device})")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as err:
            raise EnvironmentProblem(f"train.optimizer = \"{t.optimizer}\" needs "
                                     f"{spec.library}: pip install {spec.library}") from err
    if t.fused_backward and world > 1:
        raise ConfigError("train.fused_backward frees each gradient inside backward, so there "
                          "is nothing left to average across processes; turn it off for "
                          f"multi-process runs (this one has {world})")
    if t.distributed == "fsdp" and world > 1 and cfg.sample.prompts is not None:
        raise ConfigError("sample.prompts with train.distributed = \"fsdp\" on several "
                          "processes: sampling during a sharded run is not supported yet; "
                          "remove sample.prompts and sample from the saved model (difftune "
                          "sample), or train with train.distributed = \"ddp\"")
    if t.blocks_to_swap and not family.swap_blocks:  # refused at config load already
        raise ConfigError(no_swap(family.name))
    if t.blocks_to_swap and device.type == "cpu":
        log.warning("train.blocks_to_swap on the CPU saves nothing (host and device are one "
                    "memory); it runs, for testing")


def denoiser_home(cfg: RunConfig, world: int = 1) -> torch.device | None:
    """Where to load the denoiser when block swap or FSDP will place it: the host (None:
    `device`). FSDP moves each process's shard to the device as it shards the model."""
    sharded = cfg.train.distributed == "fsdp" and world > 1
    return torch.device("cpu") if cfg.train.blocks_to_swap or sharded else None


def apply(cfg: RunConfig, family: Family, denoiser: torch.nn.Module,
          device: torch.device) -> BlockSwap | None:
    """Compile the denoiser's blocks and/or install block swap (after the LoRA is added and
    checkpointing is on); returns the installed swap."""
    t = cfg.train
    swap = None
    if t.blocks_to_swap:
        blocks = blocks_of(denoiser, family.swap_blocks)
        if t.blocks_to_swap >= len(blocks):
            raise ConfigError(f"train.blocks_to_swap = {t.blocks_to_swap}, but the {family.name} "
                              f"denoiser has {len(blocks)} blocks; swap at most "
                              f"{len(blocks) - 1}")
        refuse_trained_swap(cfg, blocks[len(blocks) - t.blocks_to_swap:])
        swap = BlockSwap(blocks, t.blocks_to_swap, device)
        swap.install(denoiser)
        log.info("block swap: %d of %d denoiser blocks live in host memory", t.blocks_to_swap,
                 len(blocks))
    if t.compile:
        blocks = blocks_of(denoiser, family.compile_blocks)
        for block in blocks:
            block.compile()
        log.info("torch.compile: %d denoiser blocks (compiled on their first call)", len(blocks))
    return swap


def refuse_trained_swap(cfg: RunConfig, swapped: list[torch.nn.Module]) -> None:
    """Block swap streams frozen weights: a fully trained weight (with its optimizer state)
    in a swapped block is refused, naming the first such block."""
    if cfg.adapter.type != "full":
        return
    for i, block in enumerate(swapped):
        if any(p.requires_grad for p in block.parameters()):
            raise ConfigError(
                f"train.blocks_to_swap = {cfg.train.blocks_to_swap} would swap trained weights "
                f"(swapped block {i + 1} of {len(swapped)} is in adapter.train_blocks); swap "
                "fewer blocks, or train only blocks outside the last ones")


def describe(cfg: RunConfig, family: Family, denoiser: torch.nn.Module) -> str:
    """The memory savers in use, in one line (what `difftune check` reports)."""
    t = cfg.train
    on = []
    if t.gradient_checkpointing:
        on.append("gradient checkpointing")
    if t.blocks_to_swap:
        total = len(blocks_of(denoiser, family.swap_blocks))
        on.append(f"block swap ({t.blocks_to_swap} of {total} blocks in host memory)")
    if OPTIMIZERS[t.optimizer].cuda_only:
        on.append(f"8-bit optimizer ({t.optimizer})")
    if t.fused_backward:
        on.append("fused backward")
    if t.compile:
        on.append("torch.compile of the blocks")
    return "memory savers: " + (", ".join(on) if on else "none")
