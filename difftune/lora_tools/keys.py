"""A LoRA file's keys split into modules: how each is spelled (its prefix), which family
module it names, and its tensors by their reader names.

Trainers spell the same module several ways: diffusers' and PEFT's `transformer.<module>`,
ComfyUI's and ai-toolkit's `diffusion_model.<module>`, kohya's and musubi-tuner's
`lora_unet_<module, dots as underscores>`, SimpleTuner's (LyCORIS's) `lycoris_<...>`,
OneTrainer's `lora_transformer_<...>`, or the bare name; over either naming of the family
(`names`). The spelling is kept as found: what a program reads depends on it (`programs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from difftune.lora_tools.names import DIFFUSERS, ORIGINAL, FamilyNames

# The tensor names per module that LoRA-kind readers know (ComfyUI's `load_lora` and
# weight_adapter, LyCORIS, PEFT's DoRA magnitude), longest first when matching.
TENSOR_NAMES = ("alpha", "dora_scale", "lora_up.weight", "lora_down.weight", "lora_mid.weight",
                "lora_A.weight", "lora_B.weight", "lora.up.weight", "lora.down.weight",
                "lora_magnitude_vector", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b",
                "hada_t1", "hada_t2", "lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b",
                "lokr_w2_a", "lokr_w2_b", "lokr_t2", "diff", "diff_b", "w_norm", "b_norm",
                "set_weight")
_BY_LENGTH = sorted(TENSOR_NAMES, key=len, reverse=True)
# Spelling prefixes of denoiser modules; those ending in "_" underscore the module name.
DENOISER_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.",
                     "transformer.", "unet.", "lora_unet_", "lycoris_", "lora_transformer_", "")
# Spelling prefixes of text-encoder modules (kohya/ComfyUI's and diffusers').
TEXT_PREFIXES = ("lora_te1_", "lora_te2_", "lora_te3_", "lora_te_", "text_encoder.",
                 "text_encoder_2.", "text_encoder_3.", "text_encoders.")
DENOISER, TEXT, UNKNOWN = "denoiser", "text encoder", "unknown"


@dataclass
class Module:
    """One module of a file: its key stem, its tensors by reader name, and what it names."""

    key: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    part: str = UNKNOWN
    prefix: str = ""
    name: str = ""  # the dotted module name ("" when none of the family's names fits)
    namings: tuple[str, ...] = ()  # DIFFUSERS and/or ORIGINAL: where `name` is a module


def split_key(key: str) -> tuple[str, str]:
    """(module stem, tensor name) of a file key; ("", key) for a key of no known tensor."""
    for suffix in _BY_LENGTH:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return "", key


def group(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Module], list[str]]:
    """The file's modules by key stem, and the keys of no known tensor name."""
    modules: dict[str, Module] = {}
    stray: list[str] = []
    for key, value in tensors.items():
        stem, suffix = split_key(key)
        if not stem:
            stray.append(key)
            continue
        modules.setdefault(stem, Module(stem)).tensors[suffix] = value
    return modules, sorted(stray)


def resolve(module: Module, names: FamilyNames) -> Module:
    """`module` with what it names in a family (part, prefix, dotted name, namings)."""
    if module.key.startswith(TEXT_PREFIXES):
        module.part = TEXT
        module.prefix = next(p for p in TEXT_PREFIXES if module.key.startswith(p))
        return module
    for prefix in DENOISER_PREFIXES:
        if not module.key.startswith(prefix):
            continue
        rest, underscored = module.key[len(prefix):], prefix.endswith("_")
        found = {naming: names.naming(naming).resolve(rest, underscored)
                 for naming in (DIFFUSERS, ORIGINAL)}
        hits = {k: v for k, v in found.items() if v}
        if hits:
            module.part, module.prefix = DENOISER, prefix
            module.name = next(iter(hits.values()))
            module.namings = tuple(hits)
            return module
    return module


def read_modules(tensors: dict[str, torch.Tensor], names: FamilyNames
                 ) -> tuple[list[Module], list[str]]:
    """Every module of a file resolved against a family's names, and the stray keys."""
    modules, stray = group(tensors)
    return [resolve(m, names) for m in modules.values()], stray
