"""Where the base model's weights come from, said in each family's own words.

The messages about a missing or wrong model source, and the help of `model.path` and the
single-file keys, are written from each family's `ModelFiles` (its spec.py): the folder layout
it takes, the ComfyUI single files it reads, what the folder must hold beside them. No family
is named here, so a new family's messages and help come with its spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from difftune.families import registry
from difftune.families.specs import FamilySpec

if TYPE_CHECKING:
    from difftune.config.sections import ModelConfig

# Every single-file key of [model]; which of them a family reads is its spec's `files.singles`.
SINGLE_KEYS = ("transformer", "transformer_2", "vae", "clip_l", "t5", "text_encoder")


def _kinds() -> list[tuple[str, FamilySpec]]:
    """(label, spec) of every family and variant, labelled `family` or `family (variant)`."""
    return [(name if variant is None else f"{name} ({variant})", spec)
            for name in registry.names() for variant, spec in registry.variant_specs(name)]


def _by_text(pairs: list[tuple[str, str]]) -> str:
    """`a, b: text; c: other` from (label, text) pairs, labels with the same text joined."""
    grouped: dict[str, list[str]] = {}
    for label, text in pairs:
        grouped.setdefault(text, []).append(label)
    return "; ".join(f"{', '.join(labels)}: {text}" for text, labels in grouped.items())


def path_help() -> str:
    """The help of `model.path`: each family's folder layout."""
    layouts = _by_text([(label, spec.files.folder) for label, spec in _kinds()])
    return ("A diffusers-format folder in the layout of the family's release (" + layouts
            + "). With single files it still provides what they lack (the tokenizers).")


def single_help(key: str, what: str) -> str:
    """The help of the single-file key `key`: which families read it, and which file."""
    readers = _by_text([(label, dict(spec.files.singles)[key]) for label, spec in _kinds()
                        if key in spec.files.keys])
    return f"Single-file {what} (.safetensors), over model.path's: {readers}."


def source_problems(model: ModelConfig) -> list[str]:
    """What is wrong with a non-tiny model source: single-file keys the family does not read,
    a folder it needs but was not given, single files missing where no folder is given."""
    family = f'model.family = "{model.family}"'
    if model.variant is not None:
        family += f' (variant "{model.variant}")'
    files = registry.spec(model.family, model.variant).files
    problems = [f"model.{key}: {family} reads no such file (its single files: "
                f"{', '.join('model.' + k for k in files.keys)}); remove it"
                for key in SINGLE_KEYS if getattr(model, key) is not None and key not in files.keys]
    if model.path is not None:
        return problems
    if files.folder_holds is not None:
        problems.append(
            f"model.path is not set: {family} needs a diffusers folder in the {files.folder} "
            f"layout, also with single files, for its {files.folder_holds}; set path = that "
            f"folder (single files over its parts: {files.describe_singles()}), or "
            'flavor = "tiny"')
        return problems
    missing = [f"model.{key}" for key in files.keys if getattr(model, key) is None]
    if missing:
        problems.append(
            f'no model given: set flavor = "tiny", or path = a diffusers folder in the '
            f"{files.folder} layout, or all of {files.describe_singles()} as single files "
            f"(missing: {', '.join(missing)})")
    return problems
