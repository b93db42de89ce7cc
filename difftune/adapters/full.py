"""Full fine-tuning (`adapter.type = "full"`): the model's own weights train.

What trains: every parameter of the denoiser, or only those inside the modules that
`adapter.train_blocks` names (glob patterns over module names, e.g. `"transformer_blocks.*"`),
and every parameter of each text encoder listed in `adapter.text_encoders` (with
`adapter.type = "full"` that list means "fine-tune these encoders", not "give them a LoRA").

Precision policy: the trained parameters are fp32 master weights whatever the base's storage
dtype (`precision.denoiser` / `precision.text_encoders` then apply to the frozen rest only);
the forward pass runs in `precision.mixed` under autocast as with LoRA, and the files a run
writes are cast to `save.dtype`. A trained weight cannot be stored in fp8 or quantized (its
update would be rounded away, or there is no weight to update): that is refused at config load.

Trained parameters are named canonically `<prefix>.<parameter name>` (the diffusers names of
the module, prefixed like the LoRA keys: `transformer.`, `text_encoder.`), which is what
checkpoints store and what the optimizer state is keyed by.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch

from difftune.adapters.lora import lora_parameters
from difftune.errors import ConfigError


def _owners(name: str) -> list[str]:
    """The dotted names a parameter belongs to: its modules, outermost first, and itself."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def select(module: torch.nn.Module, patterns: list[str] | None) -> list[str]:
    """Names of the parameters inside a module matched by one of the glob `patterns` (all of
    them when None). A pattern that matches nothing is an error naming the blocks there are."""
    names = [n for n, _ in module.named_parameters()]
    if patterns is None:
        return names
    unmatched = [p for p in patterns if not any(fnmatchcase(o, p) for n in names
                                                for o in _owners(n))]
    if unmatched:
        blocks = sorted({".".join(n.split(".")[:-1][:2]) or n for n in names})  # modules
        shown = ", ".join(blocks[:12]) + (", ..." if len(blocks) > 12 else "")
        raise ConfigError(f"adapter.train_blocks: {unmatched} match no module of the "
                          f"{type(module).__name__} (its blocks: {shown}); use glob patterns "
                          "over module names, e.g. \"transformer_blocks.*\"")
    return [n for n in names if any(fnmatchcase(o, p) for o in _owners(n) for p in patterns)]


def make_trainable(module: torch.nn.Module, patterns: list[str] | None) -> list[str]:
    """Unfreeze the selected parameters as fp32 master weights (the rest stays frozen, in its
    storage dtype); returns their names."""
    names = set(select(module, patterns))
    for name, p in module.named_parameters():
        if name in names:
            if p.dtype != torch.float32:
                p.data = p.data.float()
            p.requires_grad_(True)
        else:
            p.requires_grad_(False)
    return sorted(names)


def full_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained parameters of a fully fine-tuned module, in module order."""
    return [p for p in module.parameters() if p.requires_grad]


def named_full(module: torch.nn.Module, prefix: str) -> dict[str, torch.nn.Parameter]:
    """The trained parameters by canonical name (`<prefix>.<parameter name>`)."""
    return {f"{prefix}.{n}": p for n, p in module.named_parameters() if p.requires_grad}


def trained_parameters(module: torch.nn.Module, adapter_type: str) -> list[torch.nn.Parameter]:
    """What the optimizer trains in `module` for this adapter type (its own weights for a
    full fine-tune, the LoRA factors otherwise)."""
    return full_parameters(module) if adapter_type == "full" else lora_parameters(module)
