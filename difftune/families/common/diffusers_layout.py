"""Families whose only LoRA layout is the diffusers one: ComfyUI and diffusers both read the
diffusers module names (`transformer.<module>.lora_A/B.weight`), so no kohya layout is written.

Other trainers write the same module names under other prefixes and factor names (ai-toolkit's
`diffusion_model.<module>.lora_A/B` without alpha, ComfyUI-style `lora_down`/`lora_up` with
`.alpha` entries, bare module names, kohya/musubi-tuner's `lora_unet_` and SimpleTuner's
`lycoris_` underscored names); `diffusers_names` reads them all back, so `--init-lora` takes
their files.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from difftune.families.base import Components
from difftune.families.common.family import FamilyBase

# Prefixes other tools put before the diffusers module names (ComfyUI-style; ai-toolkit's PEFT
# keys without alpha; PEFT's own `base_model.model.`), underscored module names
# (kohya/musubi-tuner's `lora_unet_`, SimpleTuner's
# LyCORIS `lycoris_`), and the factor names of `lora_down`/`lora_up` files.
FOREIGN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.")
UNDERSCORED = ("lora_unet_", "lycoris_")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}
_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight", ".alpha")


def _module_and_suffix(key: str) -> tuple[str, str]:
    """A key split into its module part and its factor/alpha suffix."""
    for suffix in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return key, ""


def _module_name(module: str, names: set[str], flat: dict[str, str], prefix: str) -> str:
    """One file's module name as `<prefix>.<diffusers module>` (as it is when it is one)."""
    for under in UNDERSCORED:
        if module.startswith(under):
            rest = module[len(under):]
            return f"{prefix}.{flat.get(rest, rest)}"
    if module in names:  # bare module names, as ComfyUI also reads them
        return f"{prefix}.{module}"
    for foreign in FOREIGN_PREFIXES:
        if module.startswith(foreign):
            return f"{prefix}.{module[len(foreign):]}"
    return module


def diffusers_names(tensors: dict[str, torch.Tensor], modules: Iterable[str] = (),
                    prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the alpha of
    each module (`<prefix>.<module>`) that has an `.alpha` entry.

    `modules` are the denoiser's module names, needed only for bare and underscored names
    (underscores are ambiguous: `transformer_blocks_0_attn_to_q` is found by matching).
    """
    names = set(modules)
    flat = {m.replace(".", "_"): m for m in names}
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in tensors.items():
        module, suffix = _module_and_suffix(key)
        module = _module_name(module, names, flat, prefix)
        if suffix == ".alpha":
            alphas[module] = float(value.item())
        else:
            out[module + FACTORS.get(suffix, suffix)] = value
    return out, alphas


class DiffusersLayoutFamily(FamilyBase):
    """A family whose LoRA files are read and written in diffusers names only."""

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names, and per-module alphas where the file has them
        (difftune's and diffusers' layout as is; other trainers' prefixes and factor names
        mapped back, see `diffusers_names`)."""
        modules = (n for n, _ in c.denoiser.named_modules() if n)
        return diffusers_names(tensors, modules, self.denoiser_prefix)

