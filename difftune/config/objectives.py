"""Which training options belong to which objective, and the ones set for the other.

A family trains with flow matching or with DDPM (its spec's `objective`); the options of the
other objective are refused when a config loads (`objective_problems`), offered only where they
apply on the web form, and left out by `difftune import` (`other_objective`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from difftune.families import registry

if TYPE_CHECKING:
    from difftune.config.sections import TrainConfig

# Options of one objective ("flow" or "ddpm", from the family's spec) refused for the other.
DDPM_ONLY = {"prediction": "auto", "zero_terminal_snr": False, "noise_offset": 0.0,
              "min_snr_gamma": None}
FLOW_ONLY = {"timesteps": "sigmoid", "sigmoid_mean": 0.0, "sigmoid_std": 1.0, "shift": 3.0}


def other_objective(family: str) -> dict[str, Any]:
    """The train options (with their defaults) of the objective `family` does not train with."""
    kind = registry.spec(family).objective
    return dict(DDPM_ONLY if kind == "flow" else FLOW_ONLY if kind == "ddpm" else {})


def objective_problems(family: str, train: TrainConfig) -> list[str]:
    """Options set for the objective this family does not train with (never silently ignored)."""
    kind = registry.spec(family).objective
    ignored = other_objective(family)
    set_here = [k for k, default in ignored.items()
                if k in train.model_fields_set and getattr(train, k) != default]
    return [f"train.{k} does not apply to model.family = \"{family}\" (trained with "
            f"{'flow matching' if kind == 'flow' else 'DDPM'}); remove it" for k in set_here]
