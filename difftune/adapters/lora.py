"""LoRA (and the other peft adapter kinds, `adapters.kinds`) on the denoiser through peft.

Targets are chosen by full-match regexes over module names (the family's presets or the user's
list) and resolved to concrete Linear layers here, so a preset that matches nothing is an
error rather than a run that trains nothing.
"""

from __future__ import annotations

import re

import torch
from peft import get_peft_model_state_dict, inject_adapter_in_model

from difftune.adapters.kinds import AdapterOptions, adapter_parameters, kind

from difftune.errors import ConfigError


def suffix_patterns(suffixes: list[str]) -> list[str]:
    """User-given module-name suffixes ("attn.to_q") as full-match regexes."""
    return [r"(?:.*\.)?" + re.escape(s) for s in suffixes]


def resolve_targets(model: torch.nn.Module, patterns: list[str],
                    layer: type[torch.nn.Module] = torch.nn.Linear) -> list[str]:
    """Names of the `layer` modules (Linear by default) whose full name matches a regex."""
    compiled = [re.compile(p) for p in patterns]
    return [
        name for name, module in model.named_modules()
        if isinstance(module, layer) and any(c.fullmatch(name) for c in compiled)
    ]


def add_lora(
    model: torch.nn.Module, patterns: list[str], rank: int, alpha: float, dropout: float,
    seed: int, kind_name: str = "lora", options: AdapterOptions | None = None,
    conv_patterns: list[str] | None = None,
) -> list[str]:
    """Inject an adapter of `kind_name` (fp32 weights) on the matching layers; returns their
    names (the Conv2d ones matched by `conv_patterns` after the Linear ones).

    The factors are initialized from `seed` (the update starts at zero: LoRA's B, LoHa's
    w2_b, LoKr's w1) without touching the global RNG. `options` carries the kind's own
    settings (DoRA, LoKr factor, conv rank); the default is plain LoRA of `rank`/`alpha`.
    """
    names = resolve_targets(model, patterns)
    if not names:
        raise ConfigError(
            f"adapter targets {patterns} match no Linear layer of the model; use a preset "
            "(adapter.targets) or module names that exist"
        )
    convs = resolve_targets(model, conv_patterns, torch.nn.Conv2d) if conv_patterns else []
    options = options or AdapterOptions(rank=rank, alpha=alpha, dropout=dropout)
    config = kind(kind_name).build(names, convs, options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name="default")
    for p in adapter_parameters(model):
        p.data = p.data.float()
        p.requires_grad_(True)
    return names + convs


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter parameters of the model (any kind: LoRA, DoRA, LoHa, LoKr), in module
    order."""
    return adapter_parameters(model)


def lora_state(model: torch.nn.Module, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """The LoRA weights in diffusers naming: `<prefix>.<module>.lora_A.weight` / `lora_B`."""
    state = get_peft_model_state_dict(model, adapter_name="default")
    return {f"{prefix}.{k}": v.detach() for k, v in state.items()}
