"""Models and LoRA helpers the SDXL and SD3 layout tests share (rank 4, alpha 6: alpha != rank,
so a reader that drops alpha is caught)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

from difftune.adapters.formats import peft_state_to_diffusers

RANK, ALPHA = 4, 6.0


def seeded(make, seed: int):
    """Build a model under a fixed seed, in eval mode."""
    torch.manual_seed(seed)
    return make().eval()


def copy_of(model: torch.nn.Module, make) -> torch.nn.Module:
    """A fresh model with `model`'s weights and no adapter."""
    fresh = make().eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


def layer_names(model: torch.nn.Module, kinds=(torch.nn.Linear, torch.nn.Conv2d)) -> list[str]:
    """Names of every module of the given kinds."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, kinds))


def with_lora(model: torch.nn.Module, targets: list[str], make, seed: int = 1) -> torch.nn.Module:
    """A copy of `model` with a peft LoRA (alpha != rank) on exactly `targets`, up factors random."""
    peft_model = copy_of(model, make)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=True)
    inject_adapter_in_model(config, peft_model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return peft_model


def diffusers_state(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The model's LoRA named as diffusers saves it (`<prefix>.<module>.lora_A.weight`)."""
    return peft_state_to_diffusers(get_peft_model_state_dict(model), prefix)


def delta(down: torch.Tensor, up: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weight change of a linear or conv LoRA, alpha/rank * up @ down, as a 2-D matrix."""
    return (up.flatten(1).float() @ down.flatten(1).float()) * (alpha / down.shape[0])
