"""Checks of a sharded run's config (`train.distributed = "fsdp"`), run at config load.

FSDP shards the denoiser's own weights, so it is for full fine-tunes; what cannot work with
weights that live in pieces on several processes is refused here, naming the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from difftune.train.optimizers.specs import OPTIMIZERS

if TYPE_CHECKING:
    from difftune.config.run import RunConfig

FSDP = "train.distributed = \"fsdp\""


def sharding_problems(cfg: RunConfig) -> list[str]:
    """What an FSDP run cannot do with the rest of the config."""
    t, a = cfg.train, cfg.adapter
    if t.distributed != "fsdp":
        return []
    problems = []
    if a.type != "full":
        problems.append(f"{FSDP} shards a full fine-tune's weights; adapter.type = \"{a.type}\" "
                        "trains a few MB that plain data-parallel training averages cheaply: set "
                        "train.distributed = \"ddp\" (or adapter.type = \"full\")")
    if a.text_encoders or a.embeddings:
        problems.append(f"{FSDP} shards the denoiser only; trained text encoders or embeddings "
                        "are not supported with it yet: remove adapter.text_encoders / "
                        "adapter.embeddings, or use train.distributed = \"ddp\"")
    if t.blocks_to_swap:
        problems.append(f"train.blocks_to_swap with {FSDP}: FSDP already keeps only one block's "
                        "whole weights on the device at a time; set blocks_to_swap = 0")
    if t.fused_backward:
        problems.append(f"train.fused_backward with {FSDP}: the optimizer step needs the sharded "
                        "gradients FSDP reduces after backward; set fused_backward = false")
    if not OPTIMIZERS[t.optimizer].shards:
        fits = ", ".join(f'"{n}"' for n, s in OPTIMIZERS.items() if s.shards)
        problems.append(f"train.optimizer = \"{t.optimizer}\" with {FSDP}: it cannot step "
                        f"sharded (DTensor) weights; use one that can: {fits}")
    if t.ema.enabled and t.ema.cpu:
        problems.append(f"train.ema.cpu with {FSDP}: the average is sharded like the weights "
                        "(each process keeps 1/N of it on its device); set train.ema.cpu = false")
    if cfg.precision.mixed == "fp16":
        problems.append(f"precision.mixed = \"fp16\" with {FSDP}: the fp16 loss scaler does not "
                        "unscale sharded gradients; use bf16")
    return problems
