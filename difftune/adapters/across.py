"""LoRAs read across families: a file difftune trained for another family, applied to this one
where this family's spec declares that family's LoRAs fit it (`FamilySpec.lora_sources`: Chroma
reads FLUX.1's), refused otherwise.

A declared file is read by its own family's LoRA reader into diffusers names (the scale folded
into the up factors), renamed as the declaration says, and left without the modules this model
lacks, each named in a warning with the reason (never dropped silently); what remains goes to
the usual readers and shape checks (`adapters.fit.check_fit` refuses a module of another
shape, naming it). Which family a file is for is its `difftune.family` metadata; a file of
another trainer, which carries none, is read so where this family's own reader refuses its
layout and a declared source's reads it (`layout_source`), and is left to the key checks
otherwise.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import torch

from difftune.adapters.formats import LORA_B, split_lora_key
from difftune.adapters.lycoris_files import needs_lycoris
from difftune.errors import CheckpointError
from difftune.families import registry
from difftune.families.base import Components, Family
from difftune.families.specs import FamilySpec, LoraSource

log = logging.getLogger("difftune")
FAMILY_KEY = "difftune.family"


def lora_source(option: str, path: Path, meta: dict[str, str],
                spec: FamilySpec) -> LoraSource | None:
    """The declared source a file of another family is read through; None for a file of
    this family or one that names none. A file of a family `spec` does not read is refused
    (CheckpointError) naming both families and the ones it reads, before its keys fail to
    match the model in a less telling way (peft's missing target modules, an expert no name
    tells, modules the run does not train)."""
    trained = meta.get(FAMILY_KEY)
    if trained is None or trained == spec.name:
        return None
    for source in spec.lora_sources:
        if source.family == trained:
            return source
    reads = [s.family for s in spec.lora_sources]
    also = f" (or, as {spec.name} reads them, one trained for {' or '.join(reads)})" if reads \
        else ""
    raise CheckpointError(f"{option} {path} is a {trained} LoRA (its {FAMILY_KEY} metadata), "
                          f"but this run's model.family is \"{spec.name}\", which does not "
                          f"read {trained} LoRAs; give a LoRA trained for {spec.name}{also}")


def layout_source(family: Family, comps: Components,
                  tensors: dict[str, torch.Tensor]) -> LoraSource | None:
    """Of a file that names no family (another trainer's), the declared source whose reader
    reads it where this family's own reader refuses it (a kohya FLUX.1 file on Chroma: FLUX.1's
    modulation layers have no Chroma name); None where this family reads it, or none does."""
    try:
        family.lora_from_format(comps, tensors)
        return None
    except CheckpointError:
        pass
    for source in family.spec.lora_sources:
        try:
            registry.get(source.family).lora_from_format(comps, tensors)
        except CheckpointError:
            continue
        return source
    return None


def read_across(option: str, path: Path, tensors: dict[str, torch.Tensor],
                meta: dict[str, str], source: LoraSource, comps: Components,
                present: set[str]) -> dict[str, torch.Tensor]:
    """A LoRA file of `source.family` as this family's diffusers-named tensors, alpha folded
    into the up factors (so alpha = rank); `present` holds this model's module names
    (`<component prefix>.<module path>`, `module_names`). Modules it lacks are warned about by
    name and left out; a file of LyCORIS kinds, or with no module left, is refused. The source
    family's reader is given this model's components (`comps`): the declared sources' readers
    take every name and shape from the file."""
    if needs_lycoris(tensors):
        raise CheckpointError(f"{option} {path}: LoHa, LoKr, DoRA and LyCORIS-named files are "
                              f"not read across families; give a plain LoRA of {source.family}")
    state, alphas = registry.get(source.family).lora_from_format(comps, tensors)
    state = _folded(state, alphas, _file_alpha(option, path, meta))
    state = {_renamed(k, source.renames): v for k, v in state.items()}
    kept, dropped = _split(state, source, present)
    for why, modules in dropped.items():
        log.warning("%s %s: %d %s module(s) not applied (%s): %s", option, path, len(modules),
                    source.family, why, summarize(modules))
    if not kept:
        raise CheckpointError(f"{option} {path}: none of its {source.family} modules is in this "
                              "model; check that it was trained for the model it is used on")
    log.info("%s %s: read as a %s LoRA (%s)", option, path, source.family, source.why)
    return kept


def _file_alpha(option: str, path: Path, meta: dict[str, str]) -> float | None:
    """The file's `difftune.alpha` (None: not given); refused unless a positive number."""
    text = meta.get("difftune.alpha")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise CheckpointError(f"{option} {path}: its difftune.alpha metadata {text!r} is not a "
                              "positive number; re-export the LoRA")
    return value


def _folded(state: dict[str, torch.Tensor], alphas: dict[str, float],
            file_alpha: float | None) -> dict[str, torch.Tensor]:
    """Each module's alpha / rank folded into its up factor: the reader's alphas (kohya
    `.alpha` entries), else the file's alpha (the rank itself in files whose scale is already
    folded; None: alpha = rank)."""
    out = {}
    for key, value in state.items():
        module, suffix = split_lora_key(key)
        alpha = alphas.get(module, file_alpha)
        scale = alpha / value.shape[1] if suffix == LORA_B and alpha is not None else 1.0
        out[key] = value * scale if scale != 1.0 else value
    return out


def _renamed(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`key` with the first matching (source prefix, this family's prefix) rename applied."""
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _split(state: dict[str, torch.Tensor], source: LoraSource, present: set[str]
           ) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """(the tensors of modules this model has, {why: [modules left out]}): a module matching
    the declaration's `lacks` is left out with its reason, any other this model lacks with a
    plain one."""
    kept: dict[str, torch.Tensor] = {}
    dropped: dict[str, list[str]] = {}
    for key, value in state.items():
        module = split_lora_key(key)[0]
        why = lacking(source, module)
        if why is None and module not in present:
            why = "this model has no module of that name"
        if why is None:
            kept[key] = value
        elif module not in dropped.setdefault(why, []):
            dropped[why].append(module)
    return kept, dropped


def lacking(source: LoraSource | None, module: str) -> str | None:
    """Why this family has no `module` of the source family's (its declaration's `lacks`
    entry the name matches), or None."""
    if source is None:
        return None
    return next((why for pattern, why in source.lacks if re.fullmatch(pattern, module)), None)


def summarize(modules: list[str]) -> str:
    """Module names with block indices folded (`transformer.transformer_blocks.N.norm1.linear
    (x19)`), in first-seen order: a released model's dozens of blocks in one line."""
    folded = Counter(re.sub(r"\.\d+\.", ".N.", m) for m in modules)
    return ", ".join(f"{name} (x{count})" if count > 1 else name
                     for name, count in folded.items())


def module_names(modules: dict[str, torch.nn.Module]) -> set[str]:
    """`<component prefix>.<module path>` of every module with a weight, of the components
    ({prefix: module}, `adapters.fit.component_modules`) a LoRA may adapt."""
    return {f"{prefix}.{name}" for prefix, model in modules.items()
            for name, module in model.named_modules()
            if name and isinstance(getattr(module, "weight", None), torch.Tensor)}
