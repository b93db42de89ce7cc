"""LoRA files written the way trainers write them, for the `difftune lora` tests.

A LoRA is made on a family's tiny denoiser (random factors on chosen Linear modules) in
diffusers' names, then spelled per trainer by the names each documents: diffusers/PEFT
`transformer.<module>.lora_A/B.weight` (SimpleTuner's and diffusers' scripts' saves),
ai-toolkit's `diffusion_model.<module>.lora_A/B.weight` (no alpha), OneTrainer's
`lora_transformer_<module_>.lora_down/up.weight` + `.alpha`, SimpleTuner's LyCORIS
`lycoris_<module_>...`, kohya/musubi-tuner's `lora_unet_<module_>` + `.alpha` (and
difftune's own kohya layout, `Family.lora_to_format`).
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

from difftune.families import registry
from difftune.families.base import Components
from difftune.lora_tools.names import tiny_components


@lru_cache(maxsize=None)
def tiny(family: str) -> Components:
    """The tiny flavor of `family` (default variant), built once per test session."""
    return tiny_components(family)


def linear_modules(family: str, pattern: str = ".*") -> list[str]:
    """The tiny denoiser's Linear modules whose names match `pattern`."""
    return [n for n, m in tiny(family).denoiser.named_modules()
            if isinstance(m, torch.nn.Linear) and re.search(pattern, n)]


def diffusers_lora(family: str, modules: list[str], rank: int = 4, seed: int = 0
                   ) -> dict[str, torch.Tensor]:
    """Random LoRA factors on `modules` in diffusers' names (`<prefix>.<module>.lora_A...`)."""
    gen = torch.Generator().manual_seed(seed)
    den, prefix = tiny(family).denoiser, registry.get(family).denoiser_prefix
    out = {}
    for name in modules:
        layer = den.get_submodule(name)
        out[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=gen)
        out[f"{prefix}.{name}.lora_B.weight"] = torch.randn(layer.out_features, rank,
                                                            generator=gen) * 0.1
    return out


def spelled(state: dict[str, torch.Tensor], prefix: str, underscored: bool,
            alpha: float | None, factors: tuple[str, str] = ("lora_A.weight", "lora_B.weight"),
            ) -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA re-spelled: `prefix` + module (dots as underscores when
    `underscored`), the factors renamed, an `.alpha` per module when `alpha` is given."""
    out = {}
    for key, value in state.items():
        stem, _, factor = key.rpartition(".lora_")
        module = stem.partition(".")[2]
        module = module.replace(".", "_") if underscored else module
        name = factors[0] if factor == "A.weight" else factors[1]
        out[f"{prefix}{module}.{name}"] = value
        if alpha is not None:
            out[f"{prefix}{module}.alpha"] = torch.tensor(float(alpha))
    return out


KOHYA_FACTORS = ("lora_down.weight", "lora_up.weight")
# trainer -> how it spells a diffusers-named LoRA (prefix, underscored, alpha, factor names)
TRAINERS = {
    "diffusers": lambda s, p: spelled(s, f"{p}.", False, None),
    "ai-toolkit": lambda s, p: spelled(s, "diffusion_model.", False, None),
    "onetrainer": lambda s, p: spelled(s, "lora_transformer_", True, 4.0, KOHYA_FACTORS),
    "simpletuner-lycoris": lambda s, p: spelled(s, "lycoris_", True, 4.0, KOHYA_FACTORS),
    "musubi": lambda s, p: spelled(s, "lora_unet_", True, 4.0, KOHYA_FACTORS),
}


def in_original_names(family: str, kohya: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A kohya file (`Family.lora_to_format`) in the original checkpoint's module names: as
    written where the family's kohya names are the original ones (SDXL, SD3); SD 1.5's kohya
    names are diffusers', spelled here in the LDM names A1111-era tools write."""
    if family != "sd15":
        return kohya
    layout = registry.get(family).single_file_layout(tiny(family))
    ldm = {p.sources[0].removesuffix(".weight").replace(".", "_"):
           k.removeprefix("model.diffusion_model.").removesuffix(".weight").replace(".", "_")
           for k, p in layout.items() if k.endswith(".weight")}
    out = {}
    for key, value in kohya.items():
        stem, _, tensor = key.partition(".")
        out[f"lora_unet_{ldm[stem.removeprefix('lora_unet_')]}.{tensor}"] = value
    return out
