"""Checks of a full fine-tune's config (`adapter.type = "full"`), run at config load.

A trained weight is an fp32 master weight (see adapters/full.py): it cannot be stored in fp8
or quantized, nor swapped out of the device between uses with its optimizer state. Options
that only mean something for another adapter type are refused or warned about here, never
silently ignored.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from difftune.config.run import RunConfig

log = logging.getLogger("difftune")

# LoRA options that a full fine-tune does not read (warned about when set).
LORA_ONLY = ("rank", "alpha", "dropout", "targets", "target_modules", "text_encoder_targets")


def full_problems(cfg: RunConfig) -> list[str]:
    """What a full fine-tune cannot do with the rest of the config."""
    a, p = cfg.adapter, cfg.precision
    if a.type != "full":
        return (["adapter.train_blocks only applies to adapter.type = \"full\"; remove it or "
                 "set adapter.type = \"full\""] if a.train_blocks is not None else [])
    problems = []
    fix = "; train in bf16/fp32 storage (the trained weights are fp32 master weights anyway)"
    if p.denoiser == "fp8":
        problems.append("precision.denoiser = \"fp8\" with adapter.type = \"full\": a trained "
                        "weight cannot be stored in fp8 (its updates would round away)" + fix)
    if p.quantize.denoiser != "none":
        problems.append(f"precision.quantize.denoiser = \"{p.quantize.denoiser}\" with "
                        "adapter.type = \"full\": a quantized base has no weights to train; "
                        "set it to \"none\" or train a LoRA")
    for name in a.text_encoders:
        if p.encoder_dtype(name) == "fp8":
            problems.append(f"precision.text_encoders: {name} is trained in full "
                            "(adapter.text_encoders) and cannot be stored in fp8" + fix)
    if a.text_encoders and p.quantize.text_encoders != "none":
        problems.append(f"precision.quantize.text_encoders = \"{p.quantize.text_encoders}\" "
                        "with fully trained text encoders (adapter.text_encoders): a quantized "
                        "encoder has no weights to train; set it to \"none\"")
    if a.embeddings:
        problems.append("adapter.embeddings with adapter.type = \"full\": train the "
                        "embeddings in a run of their own (adapter.type = \"embedding\")")
    if cfg.train.blocks_to_swap and a.train_blocks is None:
        problems.append("train.blocks_to_swap with adapter.type = \"full\" would swap trained "
                        "blocks (their weights and optimizer state on and off the device every "
                        "step); turn block swap off, or train only other blocks "
                        "(adapter.train_blocks)")
    return problems


def warn_ignored_full(cfg: RunConfig) -> None:
    """One warning per LoRA option set in a full fine-tune's config (it is not read)."""
    a = cfg.adapter
    if a.type != "full":
        return
    for name in LORA_ONLY:
        if name in a.model_fields_set:
            log.warning("adapter.%s is ignored: adapter.type = \"full\" trains the weights "
                        "themselves", name)
    if cfg.save.format is not None:
        log.warning("save.format is ignored: a full fine-tune is written as a diffusers folder "
                    "(and the family's single file), not as a LoRA")
