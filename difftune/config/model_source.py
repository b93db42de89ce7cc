"""Where the base model's weights come from, said in each family's own words.

The messages about a missing or wrong model source, and the help of `model.path` and the
single-file keys, are written from each family's `ModelFiles` (its spec.py): the folder layout
it takes, the ComfyUI single files it reads, what the folder must hold beside them. No family
is named here, so a new family's messages and help come with its spec.

A denoiser file is also checked against the family, from its tensors' names
(`families.detect`): the family is never guessed from a file, only checked, so a file of another
family than model.family (or than the default, when the run file names none) is refused with the
line to write.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftune.families import detect, registry
from difftune.families.specs import FamilySpec

if TYPE_CHECKING:
    from difftune.config.sections import ModelConfig

# Every single-file key of [model]; which of them a family reads is its spec's `files.singles`.
SINGLE_KEYS = ("transformer", "transformer_2", "vae", "clip_l", "t5", "text_encoder",
               "image_encoder")


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


def _denoiser_keys() -> list[str]:
    """The single-file keys any family reads its denoiser (or whole checkpoint) from."""
    return sorted({spec.files.singles[0][0] for _, spec in _kinds() if spec.files.singles})


def _family_lines(family: str, variant: str | None) -> str:
    """The run file's lines that pick `family` (and `variant`, where the file tells it)."""
    told = variant is not None and len(registry.variant_specs(family)) > 1
    return f'model.family = "{family}"' + (f' and model.variant = "{variant}"' if told else "")


def _denoiser_files(model: dict[str, Any], base: Path) -> list[tuple[str, Path]]:
    """(key, file) of the denoiser files the raw [model] table names that exist, relative
    paths resolved against `base` as `load_config` resolves them."""
    out = []
    for key in _denoiser_keys():
        value = model.get(key)
        path = Path(value).expanduser() if isinstance(value, str) else None
        path = path if path is None or path.is_absolute() else base / path
        if path is not None and path.is_file():
            out.append((key, path))
    return out


def family_problem(model: Any, base: Path, default: str) -> str | None:
    """Why the run file's raw [model] table (`model`, paths relative to `base`) names a denoiser
    file that another family's markers fit but not its model.family's (`default` where it names
    none), or None. Read before validation: an unset family's defaults would otherwise be
    reported (a FLUX.1 file list for an SDXL checkpoint). A file no family's markers fit is
    left to the family's loader."""
    if not isinstance(model, dict) or model.get("flavor") is not None:
        return None
    given = model.get("family")
    if given is not None and given not in registry.names():
        return None  # validation names the choices
    for key, path in _denoiser_files(model, base):
        found = detect.file_families(path)
        if not found or (given or default) in [name for name, _ in found]:
            continue
        family, variant = found[0]
        shows = f'its tensors are a "{family}"' + (f' ("{variant}")' if variant else "") + \
            " denoiser's"
        if given is None:
            return (f"model.{key}: {path}: {shows}, but the run file sets no model.family, "
                    f'which then is "{default}"; add {_family_lines(family, variant)} to its '
                    "[model] (the family is never guessed from a file, only checked)")
        return (f'model.{key}: {path}: {shows}, not model.family = "{given}"\'s; set '
                f"{_family_lines(family, variant)}, or give a {given} file")
    return None
