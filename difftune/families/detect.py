"""Which family a single `.safetensors` denoiser file is, from its tensors' names alone.

The names come from the file's JSON header (no tensor is loaded; the header is bounded) and are
matched against each family's `files.markers` and `files.unmarked` (families/*/spec.py), so a
new family is recognised through its spec. Both the web app's model picker (ui/models.py) and
the run-file check (config/model_source.py: a file of another family than model.family, or
than the default when the run file names none) read files through here.
"""

from __future__ import annotations

import json
import re
import struct
from functools import cache
from pathlib import Path

from difftune.families import registry
from difftune.families.specs import ModelFiles

MAX_HEADER = 64 << 20  # a safetensors header larger than this is not read (real ones: < 10 MiB)


def safetensors_names(path: Path) -> list[str]:
    """The tensor names of a .safetensors file, from its header alone (ValueError when the
    file is not one, or its header is larger than MAX_HEADER)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise ValueError(f"header of {size} bytes, more than the {MAX_HEADER} read")
        data = f.read(size)
    if len(data) < size:
        raise ValueError("header cut short")
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return [k for k in header if k != "__metadata__"]


def _pattern(module: str) -> re.Pattern[str]:
    """Tensor names lying under dotted module path `module` (after any prefix)."""
    return re.compile(r"(?:^|\.)" + re.escape(module) + r"(?:\.|$)")


@cache
def _compiled(files: ModelFiles) -> tuple[tuple[tuple[re.Pattern[str], ...], ...],
                                          tuple[re.Pattern[str], ...]]:
    """`files`' markers and unmarked paths as patterns (compiled once per spec)."""
    return (tuple(tuple(_pattern(m) for m in alt) for alt in files.markers),
            tuple(_pattern(m) for m in files.unmarked))


def _fits(files: ModelFiles, names: list[str]) -> bool:
    """Whether tensor `names` are those of a denoiser `files` describes."""
    markers, unmarked = _compiled(files)
    held = lambda p: any(p.search(n) for n in names)  # noqa: E731
    return any(all(held(p) for p in alt) for alt in markers) and \
        not any(held(p) for p in unmarked)


def families_of(names: list[str]) -> list[tuple[str, str | None]]:
    """(family, variant) of every family whose markers tensor `names` fit, in registry order;
    the variant is None where the weights do not tell the family's variants apart."""
    found = []
    for family in registry.names():
        fitting = [v for v, spec in registry.variant_specs(family) if _fits(spec.files, names)]
        if fitting:
            found.append((family, fitting[0] if len(fitting) == 1 else None))
    return found


def recognise_names(names: list[str]) -> tuple[str, str | None] | None:
    """(family, variant) of a denoiser with tensor `names` (the first family that fits, see
    `families_of`). None: no family's markers fit."""
    return next(iter(families_of(names)), None)


def file_families(path: Path) -> list[tuple[str, str | None]]:
    """`families_of` the denoiser file `path`: empty where it cannot be read as a safetensors
    file or no family's markers fit (its family's loader then says what it lacks)."""
    try:
        return families_of(safetensors_names(path))
    except (OSError, ValueError, struct.error):
        return []
