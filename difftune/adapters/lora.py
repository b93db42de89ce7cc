"""LoRA on the denoiser through peft.

Targets are chosen by full-match regexes over module names (the family's presets or the user's
list) and resolved to concrete Linear layers here, so a preset that matches nothing is an
error rather than a run that trains nothing.
"""

from __future__ import annotations

import re

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

from difftune.errors import ConfigError


def suffix_patterns(suffixes: list[str]) -> list[str]:
    """User-given module-name suffixes ("attn.to_q") as full-match regexes."""
    return [r"(?:.*\.)?" + re.escape(s) for s in suffixes]


def resolve_targets(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """Names of the Linear layers whose full name matches one of the regexes `patterns`."""
    compiled = [re.compile(p) for p in patterns]
    return [
        name for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(c.fullmatch(name) for c in compiled)
    ]


def add_lora(
    model: torch.nn.Module, patterns: list[str], rank: int, alpha: float, dropout: float,
    seed: int,
) -> list[str]:
    """Inject a LoRA adapter (fp32 weights) on the matching layers; returns their names.

    The LoRA A matrices are initialized from `seed` (B starts at zero, so the model's output is
    unchanged until the first step) without touching the global RNG.
    """
    names = resolve_targets(model, patterns)
    if not names:
        raise ConfigError(
            f"adapter targets {patterns} match no Linear layer of the model; use a preset "
            "(adapter.targets) or module names that exist"
        )
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names,
                        init_lora_weights=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name="default")
    for p in lora_parameters(model):
        p.data = p.data.float()
        p.requires_grad_(True)
    return names


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA parameters of the model, in module order."""
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def lora_state(model: torch.nn.Module, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """The LoRA weights in diffusers naming: `<prefix>.<module>.lora_A.weight` / `lora_B`."""
    state = get_peft_model_state_dict(model, adapter_name="default")
    return {f"{prefix}.{k}": v.detach() for k, v in state.items()}
