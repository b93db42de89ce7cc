"""`difftune lora inspect FILE`: what a LoRA file is, whoever wrote it.

Family, adapter kind(s), layout (how its keys are spelled), the trainer that most likely wrote
it, ranks and alphas (per module where they vary), strength, metadata, trained modules by
block, and any NaN/inf. Read-only; the same report as text or JSON.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from difftune.adapters.formats import load_lora_file, non_finite
from difftune.lora_tools import kinds
from difftune.lora_tools.detect import detect
from difftune.lora_tools.keys import DENOISER, TEXT, Module
from difftune.lora_tools.names import DIFFUSERS
from difftune.lora_tools.trainers import likely_trainer

_METADATA_PREFIXES = ("ss_", "modelspec.", "difftune.", "lora_adapter_metadata", "software")
# How each spelling prefix is called in the report (its naming is added).
_SPELLINGS = {"transformer.": "diffusers/PEFT", "unet.": "diffusers/PEFT",
              "base_model.model.": "PEFT (wrapped)", "diffusion_model.": "ComfyUI-style",
              "model.diffusion_model.": "ComfyUI-style", "lora_unet_": "kohya",
              "lycoris_": "LyCORIS", "lora_transformer_": "OneTrainer", "": "bare names"}


@dataclass
class ModuleFacts:
    """One trained module as the report lists it."""

    name: str
    kind: str
    rank: int | None
    alpha: float | None
    scale: float | None
    strength: float | None


@dataclass
class Inspection:
    """Everything `inspect` reports about one file."""

    path: str
    family: str
    also_fits: list[str]
    kinds: dict[str, int]
    layouts: dict[str, int]
    trainer: str
    trainer_evidence: str
    ranks: dict[str, int]
    alphas: dict[str, int]
    strength: dict[str, float]
    metadata: dict[str, str]
    blocks: dict[str, int]
    text_encoder_modules: int
    unresolved: list[str]
    non_finite: dict[str, str]
    modules: list[ModuleFacts] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        """The report as plain JSON values."""
        return asdict(self)


def layout_label(module: Module) -> str:
    """A module's layout as the report names it: its spelling and naming."""
    spelled = _SPELLINGS.get(module.prefix, module.prefix)
    naming = "diffusers names" if DIFFUSERS in module.namings else "original names"
    return f"{spelled} ({naming})"


def block_of(name: str) -> str:
    """The block a module sits in: its name up to the first index (`double_blocks.3`), or
    its first part for a module outside the blocks."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def module_facts(module: Module, default_alpha: float | None) -> ModuleFacts:
    """Kind, rank, alpha, scale and strength of one module."""
    rank = kinds.rank(module.tensors)
    alpha = kinds.alpha(module.tensors, default_alpha)
    scale = alpha / rank if alpha is not None and rank else None
    power = kinds.strength(module.tensors, scale) if scale is not None else None
    return ModuleFacts(module.name or module.key, kinds.kind(module.tensors), rank, alpha,
                       scale, power)


def inspect_file(path: str | os.PathLike[str], family: str | None = None) -> Inspection:
    """The report of the LoRA file at `path` (CheckpointError for one no reader can use)."""
    tensors, metadata = load_lora_file(path)
    name, others, modules, stray = detect(tensors, metadata, path, family)
    denoiser = [m for m in modules if m.part == DENOISER]
    facts = [module_facts(m, kinds.file_alpha(metadata)) for m in denoiser]
    powers = [f.strength for f in facts if f.strength is not None]
    return Inspection(
        path=str(Path(path)), family=name, also_fits=others,
        kinds=dict(Counter(f.kind for f in facts)),
        layouts=dict(Counter(layout_label(m) for m in denoiser)),
        trainer=(trainer := likely_trainer(metadata, {(m.prefix, t) for m in modules
                                                      for t in m.tensors}))[0],
        trainer_evidence=trainer[1],
        ranks=_counts(f.rank for f in facts), alphas=_counts(f.alpha for f in facts),
        strength=({"mean": sum(powers) / len(powers), "max": max(powers)} if powers else {}),
        metadata={k: v for k, v in sorted(metadata.items()) if k.startswith(_METADATA_PREFIXES)},
        blocks=dict(sorted(Counter(block_of(f.name) for f in facts).items())),
        text_encoder_modules=sum(m.part == TEXT for m in modules),
        unresolved=sorted(m.key for m in modules if m.part not in (DENOISER, TEXT)) + stray,
        non_finite=non_finite(tensors), modules=facts)


def _counts(values: object) -> dict[str, int]:
    """{value as text: how many modules have it}."""
    return {str(k): v for k, v in Counter(values).items()}  # type: ignore[call-overload]
