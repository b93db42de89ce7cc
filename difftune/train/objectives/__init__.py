"""Training objectives: how clean latents become a noisy input, a target and loss weights.

`base` holds what they share (`Draw`, the `Objective` protocol); `flow` is rectified
flow (FLUX.1, SD3), `ddpm` discrete DDPM (SDXL). A family's `objective()` picks one.
"""

from __future__ import annotations

from difftune.train.objectives.base import Draw, Objective
from difftune.train.objectives.flow import FlowMatching

__all__ = ["Draw", "FlowMatching", "Objective"]
