"""Helpers for the families diffusers ships as modular pipelines only (Anima, FLUX.3)."""

from __future__ import annotations

from typing import Any


def quiet(block: Any) -> None:
    """No progress bar from `block` or any block nested in it. ModularPipeline's
    set_progress_bar_config (diffusers 0.42.1) reaches only the top-level blocks, not the
    denoise loop nested in an AutoBlocks' denoise step, whose bar then prints on every sample
    (in `check`, in the training log, in `difftune sample`)."""
    if hasattr(block, "set_progress_bar_config"):
        block.set_progress_bar_config(disable=True)
    for sub in getattr(block, "sub_blocks", {}).values():
        quiet(sub)
