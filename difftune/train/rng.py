"""The random states a training step draws from, captured and put back exactly.

`GlobalRngs` covers the process-global generators (python, numpy, torch CPU and CUDA), which a
sample event or a failing step must leave untouched. `RunRngs` adds the run's own noise
generator and is the part of the training state a checkpoint saves: tensors for safetensors,
plain values for JSON, so reading them back never runs code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class GlobalRngs:
    """The process-global RNG states a step draws from (python, numpy, torch CPU and CUDA):
    captured before something that must leave no trace (a sample event, a step that may
    fail) and put back after it."""

    python: Any
    numpy: Any
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> "GlobalRngs":
        """The states now."""
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(),
                   torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def restore(self) -> None:
        """Put the captured states back."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class RunRngs:
    """Every RNG a step touches: the run's noise generator and the global ones."""

    generator: torch.Generator

    def state_dict(self) -> dict[str, Any]:
        """{"tensors": for safetensors, "plain": python and numpy states as JSON}."""
        tensors = {"torch_cpu": torch.get_rng_state(), "generator": self.generator.get_state()}
        if torch.cuda.is_available():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"cuda_{i}"] = state
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, py_state, py_gauss = random.getstate()
        return {"tensors": tensors,
                "plain": {"python": [version, list(py_state), py_gauss],
                          "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (CUDA states only for the devices present now)."""
        tensors, plain = state["tensors"], state["plain"]
        torch.set_rng_state(tensors["torch_cpu"])
        self.generator.set_state(tensors["generator"])
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                if f"cuda_{i}" in tensors:
                    torch.cuda.set_rng_state(tensors[f"cuda_{i}"], i)
        version, py_state, py_gauss = plain["python"]
        random.setstate((version, tuple(py_state), py_gauss))
        kind, keys, pos, has_gauss, gauss = plain["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def seed_everything(seed: int) -> None:
    """Seed the global RNGs (python, numpy, torch CPU and CUDA) a step draws from (LoRA
    dropout, for one): a run depends on its seed alone, not on what ran before it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
