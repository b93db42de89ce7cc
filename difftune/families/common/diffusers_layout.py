"""Families whose only LoRA layout is the diffusers one: ComfyUI and diffusers both read the
diffusers module names (`transformer.<module>.lora_A/B.weight`), so no kohya layout is written.

Other trainers write the same module names under other prefixes and factor names (ai-toolkit's
`diffusion_model.<module>.lora_A/B` without alpha, ComfyUI-style `lora_down`/`lora_up` with
`.alpha` entries); `diffusers_names` reads them all back, so `--init-lora` takes their files.
"""

from __future__ import annotations

import torch

from difftune.errors import ConfigError
from difftune.families.base import Components
from difftune.families.common.family import FamilyBase

# Prefixes other tools put before the diffusers module names, and their factor names.
FOREIGN_PREFIXES = ("diffusion_model.", "model.diffusion_model.")
FACTORS = {".lora_down.weight": ".lora_A.weight", ".lora_up.weight": ".lora_B.weight"}


def diffusers_names(tensors: dict[str, torch.Tensor], prefix: str = "transformer"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A LoRA state in diffusers names (`<prefix>.<module>.lora_A/B.weight`) and the alpha of
    each module (`<prefix>.<module>`) that has an `.alpha` entry."""
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in tensors.items():
        name = key
        for foreign in FOREIGN_PREFIXES:
            if name.startswith(foreign):
                name = f"{prefix}.{name[len(foreign):]}"
                break
        for old, new in FACTORS.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
        if name.endswith(".alpha"):
            alphas[name[: -len(".alpha")]] = float(value.item())
        else:
            out[name] = value
    return out, alphas


class DiffusersLayoutFamily(FamilyBase):
    """A family whose LoRA files are read and written in diffusers names only."""

    def lora_from_format(self, c: Components, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A LoRA file in diffusers names, and per-module alphas where the file has them
        (difftune's and diffusers' layout as is; other trainers' prefixes and factor names
        mapped back, see `diffusers_names`)."""
        return diffusers_names(tensors, self.denoiser_prefix)

    def to_kohya(self, c: Components, state: dict[str, torch.Tensor], rank: int, alpha: float
                 ) -> dict[str, torch.Tensor]:
        """Refused: the diffusers layout is the one ComfyUI and diffusers read."""
        raise ConfigError(f'save.format = "kohya" is not written for model.family = '
                          f'"{self.spec.name}": ComfyUI and diffusers both read its diffusers '
                          'layout; use save.format = "diffusers"')
