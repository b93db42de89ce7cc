"""Exact-resume state: what a checkpoint folder holds besides the LoRA, and how it comes back.

Everything is tensors in safetensors files or plain JSON, so loading a checkpoint never runs
code (no pickle, no `torch.load`). Parameters are named canonically, by their diffusers LoRA
key (`transformer.<module>.lora_A.weight`), never by position or by peft / quantizer internals,
so a checkpoint resumes on a base quantized differently, or not at all.

Folder layout (`checkpoints/step-000123/`):
- `trainable.safetensors`: the trained weights (fp32) by canonical name;
- `optimizer.safetensors`: each parameter's optimizer state as `<name>::<key>`;
- `rng.safetensors`: torch CPU, each CUDA device, and the run's noise generator;
- `state.json`: step, sampler position, optimizer groups, LR schedule, loss scaler, python and
  numpy RNG, counters, identity of the adapter, resolved config, versions; written last, so a
  folder without it is an interrupted save;
- the LoRA in the configured format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from difftune.errors import CheckpointError

SEP = "::"


@dataclass
class TrainState:
    """Where a run stands after an optimizer step; what `train` continues from."""

    step: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state by canonical name (`names`: id(param) -> name)."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{names[id(p)]}{SEP}{key}"] = tensor.detach().cpu().contiguous()
    return out


def optimizer_groups(opt: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's groups (hyper-parameters as JSON, parameters by canonical name)."""
    groups = []
    for group in opt.param_groups:
        entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                 if k != "params"}
        entry["params"] = [names[id(p)] for p in group["params"]]
        groups.append(entry)
    return groups


def load_optimizer(opt: torch.optim.Optimizer, names: dict[int, str],
                   groups: list[dict[str, Any]], tensors: dict[str, torch.Tensor]) -> None:
    """Put saved state back into an optimizer built for the same named parameters."""
    by_name = {names[id(p)]: p for g in opt.param_groups for p in g["params"]}
    saved = [n for g in groups for n in g["params"]]
    if sorted(saved) != sorted(by_name) or len(groups) != len(opt.param_groups):
        missing = sorted(set(saved) ^ set(by_name))[:5]
        raise CheckpointError(f"the checkpoint's optimizer holds other parameters than this run "
                              f"(first differences: {missing}); resume with the same adapter")
    for group, entry in zip(opt.param_groups, groups):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in entry.items()
                      if k != "params"})
        group["params"] = [by_name[n] for n in entry["params"]]
    opt.state.clear()
    for key, value in tensors.items():
        name, _, item = key.rpartition(SEP)
        param = by_name[name]
        # Plain numbers were saved as 0-d int64 tensors (bitsandbytes keeps "step" an int).
        plain = value.dim() == 0 and value.dtype == torch.int64
        opt.state.setdefault(param, {})[item] = int(value) if plain else value.to(param.device)


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


def rng_state(generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every RNG a step touches: (tensors for safetensors, JSON for python and numpy)."""
    tensors = {"torch_cpu": torch.get_rng_state(), "generator": generator.get_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return tensors, {"python": [version, list(py_state), py_gauss],
                     "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}


def set_rng_state(generator: torch.Generator, tensors: dict[str, torch.Tensor],
                  plain: dict[str, Any]) -> None:
    """Restore what `rng_state` saved (CUDA states only for the devices present now)."""
    torch.set_rng_state(tensors["torch_cpu"])
    generator.set_state(tensors["generator"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda_{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda_{i}"], i)
    version, py_state, py_gauss = plain["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, gauss = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
