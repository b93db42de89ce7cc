"""The model picker's scan: model folders and files under the app's roots, each recognised as a
family (and variant) from what the files hold, never from their names.

A diffusers folder (one holding `model_index.json`, or a modular pipeline's
`modular_model_index.json`) is recognised by the pipeline class it names (`_class_name`, the
family's `pipeline_class`, a variant's through `variant_of_pipeline`); a single
`.safetensors` file by its tensors' names, read from the file's JSON header alone and matched
against each family's `files.markers` (families/detect.py, which the run-file check shares). A
file no family's markers fit, a text encoder or an autoencoder included, is "unknown". The walk
is bounded in depth and in entries, follows no links out of the roots, and runs off the event
loop (the page calls it through `run.io_bound`).
"""

from __future__ import annotations

import json
import os
import struct
from functools import cache
from pathlib import Path

from pydantic import BaseModel, Field

from difftune.families import registry
from difftune.families.detect import recognise_names, safetensors_names
from difftune.families.specs import FamilySpec
from difftune.ui.security import Roots

MAX_INDEX = 1 << 20  # model_index.json larger than this is not read
MAX_DEPTH = 4  # folders below a root
MAX_ENTRIES = 20_000  # directory entries looked at, all roots together
UNKNOWN = "unknown"


class Found(BaseModel):
    """A model folder or file: what it is (`family` UNKNOWN when nothing fits), and the run
    file's `model` lines that pick it (`fields`, by form path)."""

    path: str
    kind: str = Field(description='"folder" (a diffusers folder) or "file" (.safetensors)')
    family: str = Field(UNKNOWN, description='the family, or "unknown"')
    variant: str | None = Field(None, description="the variant, where the files tell it")
    why: str = Field("", description="what told the family (or why none fits)")
    fields: dict[str, str | None] = Field(
        default_factory=dict, description="the run file's model lines that pick it")


def _denoisers(spec: FamilySpec) -> frozenset[str]:
    """The pipeline components a variant trains: its experts' parts, else its denoiser's."""
    return frozenset(e.part for e in spec.experts) or frozenset({spec.denoiser_part})


def recognise_pipeline(pipeline: str, held: frozenset[str] | None = None
                       ) -> tuple[str, str | None] | None:
    """(family, variant) of a diffusers folder whose model_index.json names `pipeline` and
    holds components `held` (those not null). Variants sharing the pipeline are told apart by
    the denoisers the folder holds (Wan 2.2 A14B's folder: both experts, the variant that
    trains both); the variant is None where that leaves several (Wan 2.1's sizes: the run
    file's variant, or the family's default, then picks)."""
    for family in registry.names():
        fitting = [(v, spec) for v, spec in registry.variant_specs(family)
                   if spec.pipeline_class == pipeline]
        if not fitting:
            continue
        parts = frozenset().union(*(_denoisers(spec) for _, spec in fitting))
        if held is not None and len(fitting) > 1:
            fitting = [(v, s) for v, s in fitting if _denoisers(s) == held & parts] or fitting
        return family, fitting[0][0] if len(fitting) == 1 else None
    return None


@cache
def _single_keys() -> tuple[str, ...]:
    """Every family's single-file keys of `model` (a picked folder replaces them all)."""
    return tuple(sorted({k for family in registry.names()
                         for _, spec in registry.variant_specs(family) for k in spec.files.keys}))


# The files that make a diffusers folder and name its pipeline: a pipeline's, and a modular
# pipeline's (families diffusers ships as modular pipelines only, such as Anima).
INDEXES = ("model_index.json", "modular_model_index.json")


def _index(folder: Path) -> Path | None:
    """The folder's pipeline index (`INDEXES`, in that order), or None: not a model folder."""
    return next((folder / n for n in INDEXES if (folder / n).is_file()), None)


def recognise_folder(folder: Path) -> Found:
    """A diffusers folder, recognised by its model_index.json (or a modular pipeline's
    modular_model_index.json; its fields unset the single files a run file may name, which
    would be read over the folder)."""
    found = Found(path=str(folder), kind="folder")
    index = _index(folder) or folder / INDEXES[0]
    try:
        if index.stat().st_size > MAX_INDEX:
            raise ValueError("too large to be a model_index.json")
        entries = json.loads(index.read_text(encoding="utf-8"))
        pipeline = entries.get("_class_name")
    except (OSError, ValueError, AttributeError) as err:
        found.why = f"{index.name} cannot be read ({err})"
        return found
    held = frozenset(k for k, v in entries.items()
                     if isinstance(v, list) and any(x is not None for x in v))
    known = recognise_pipeline(str(pipeline), held)
    if known is None:
        found.why = f"its pipeline {pipeline!r} is no family's"
        return found
    found.family, found.variant = known
    found.why = f"{index.name} names {pipeline}"
    found.fields = {"model.family": found.family, "model.variant": found.variant,
                    "model.path": str(folder), **{f"model.{k}": None for k in _single_keys()}}
    return found


def recognise_file(path: Path) -> Found:
    """A single .safetensors file, recognised by its tensors' names."""
    found = Found(path=str(path), kind="file")
    try:
        names = safetensors_names(path)
    except (OSError, ValueError, struct.error) as err:
        found.why = f"not a readable safetensors file ({err})"
        return found
    known = recognise_names(names)
    if known is None:
        found.why = f"its {len(names)} tensors are no family's denoiser"
        return found
    found.family, found.variant = known
    key = registry.spec(found.family, found.variant).files.singles[0][0]
    found.why = f"its tensors are a {found.family} denoiser's"
    found.fields = {"model.family": found.family, "model.variant": found.variant,
                    f"model.{key}": str(path)}
    return found


def scan(roots: Roots, depth: int = MAX_DEPTH, entries: int = MAX_ENTRIES) -> list[Found]:
    """Every model folder and .safetensors file under `roots` (at most `depth` folders down,
    `entries` directory entries looked at), each recognised. Hidden folders, the app's own
    folder and links leading out of the roots are skipped; a model folder is not entered."""
    out: list[Found] = []
    budget = [entries]
    for root in roots.folders:
        _walk(roots, root, depth, budget, out)
    return out


def _walk(roots: Roots, folder: Path, depth: int, budget: list[int], out: list[Found]) -> None:
    """Scan `folder` into `out`, spending `budget[0]` entries. A model folder whose index
    leads out of the roots (a link) is listed unread."""
    index = _index(folder)
    if index is not None:
        out.append(recognise_folder(folder) if roots.holds(index) else Found(
            path=str(folder), kind="folder", why=f"{index.name} leads outside the folders "
            "this app serves (a link); it is not read"))
        return
    try:
        listing = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in listing:
        if budget[0] <= 0:
            return
        budget[0] -= 1
        path = Path(entry.path)
        if entry.name.startswith(".") or not roots.holds(path):
            continue
        if entry.is_dir() and depth > 0:
            _walk(roots, path, depth - 1, budget, out)
        elif entry.is_file() and entry.name.endswith(".safetensors"):
            out.append(recognise_file(path))
