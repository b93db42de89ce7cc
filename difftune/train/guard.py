"""Non-finite losses: skipped and counted, and a run that keeps producing them is stopped.

A NaN or inf loss is never backpropagated and its step applies nothing. With fp16, the loss
scaler also skips steps whose gradients overflowed; both counts go to metrics.jsonl. After
`train.max_nonfinite_steps` non-finite losses in a row the run stops with a LoRA saved from the
last good weights and a message naming the likely cause.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from difftune.errors import DifftuneError

log = logging.getLogger("difftune")


class TrainingDiverged(DifftuneError):
    """The loss stayed non-finite: the run was stopped (a LoRA of the last good step was saved)."""


class NonFiniteGuard:
    """Counts skipped steps; says when to stop and why."""

    def __init__(self, limit: int, mixed: str, lr: float) -> None:
        self.limit, self.mixed, self.lr = limit, mixed, lr
        self.in_row = self.skipped = self.overflow = 0
        self._scale: float | None = None

    def skip(self, step: int, loss: float) -> bool:
        """True (and counted, with a warning) when `loss` is NaN or inf."""
        if math.isfinite(loss):
            self.in_row = 0
            return False
        self.in_row += 1
        self.skipped += 1
        log.warning("step %d: the loss is %s; the step was skipped (%d in a row, the run stops "
                    "at %d)", step, loss, self.in_row, self.limit)
        return True

    @property
    def exhausted(self) -> bool:
        """Whether `train.max_nonfinite_steps` non-finite losses came in a row."""
        return self.in_row >= self.limit

    def scaler_skipped(self, scaler: torch.amp.GradScaler) -> None:
        """Count a step the fp16 loss scaler skipped (its scale went down: gradients overflowed)."""
        if not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())
        if self._scale is not None and scale < self._scale:
            self.overflow += 1
            log.debug("fp16 gradients overflowed; the scaler skipped the step (scale %g)", scale)
        self._scale = scale

    def state_dict(self) -> dict[str, float]:
        """Everything a resume needs to go on counting as if it never stopped."""
        return {"in_row": self.in_row, "skipped": self.skipped, "overflow": self.overflow,
                "scale": self._scale if self._scale is not None else -1.0}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue from `state_dict()`."""
        self.in_row = int(state.get("in_row", 0))
        self.skipped = int(state.get("skipped", 0))
        self.overflow = int(state.get("overflow", 0))
        scale = float(state.get("scale", -1.0))
        self._scale = None if scale < 0 else scale

    def counts(self) -> dict[str, float]:
        """The counters for metrics.jsonl."""
        return {"skipped_nonfinite": self.skipped, "skipped_overflow": self.overflow}

    def message(self, step: int, saved: Path) -> str:
        """Why the run stopped, the likely cause and the fix."""
        if self.mixed == "fp16":
            cause = ("likely an fp16 overflow in the forward pass; use precision.mixed = "
                     "\"bf16\" (same memory, far wider range), or lower train.lr")
        else:
            cause = (f"likely a learning rate too high for this model (train.lr = {self.lr:g}) "
                     "or broken data; lower train.lr, and check the images of the last steps")
        return (f"the loss was not finite for {self.in_row} steps in a row (up to step {step}; "
                f"train.max_nonfinite_steps = {self.limit}): {cause}. The LoRA of the last good "
                f"step was saved to {saved}")
