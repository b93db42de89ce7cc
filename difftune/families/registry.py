"""The registry of model families: name -> (spec module, family class), imported lazily.

Adding a family is one folder under `families/` plus one line here. Config validation, the CLI
and the tests read the names and specs from here; `get` builds the family object (importing
torch and the model libraries only then).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from difftune.errors import ConfigError
from difftune.families.specs import FamilySpec

if TYPE_CHECKING:
    from difftune.families.base import Family

# name -> (module holding SPEC, "module.Class" of the Family implementation).
FAMILIES: dict[str, tuple[str, str]] = {
    "flux": ("difftune.families.flux.spec", "difftune.families.flux.family.FluxFamily"),
    "sd3": ("difftune.families.sd3.spec", "difftune.families.sd3.family.SD3Family"),
    "sdxl": ("difftune.families.sdxl.spec", "difftune.families.sdxl.family.SDXLFamily"),
    "chroma": ("difftune.families.chroma.spec", "difftune.families.chroma.family.ChromaFamily"),
    "z_image": ("difftune.families.z_image.spec", "difftune.families.z_image.family.ZImageFamily"),
    "qwen_image": ("difftune.families.qwen_image.spec",
                   "difftune.families.qwen_image.family.QwenImageFamily"),
    "flux2": ("difftune.families.flux2.spec", "difftune.families.flux2.family.Flux2Family"),
    "krea2": ("difftune.families.krea2.spec", "difftune.families.krea2.family.Krea2Family"),
    "wan": ("difftune.families.wan.spec", "difftune.families.wan.family.WanFamily"),
    "sd15": ("difftune.families.sd15.spec", "difftune.families.sd15.family.SD15Family"),
    "ernie_image": ("difftune.families.ernie_image.spec",
                    "difftune.families.ernie_image.family.ErnieImageFamily"),
    "anima": ("difftune.families.anima.spec", "difftune.families.anima.family.AnimaFamily"),
    "flux3": ("difftune.families.flux3.spec", "difftune.families.flux3.family.Flux3Family"),
    "qwen_image_21": ("difftune.families.qwen_image_21.spec",
                      "difftune.families.qwen_image_21.family.QwenImage21Family"),
}


def names() -> tuple[str, ...]:
    """The registered family names, in registry order."""
    return tuple(FAMILIES)


def _check(name: str) -> None:
    """Refuse a name that is not registered, naming the choices."""
    if name not in FAMILIES:
        raise ConfigError(f"model.family = {name!r} is unknown; choose one of {sorted(FAMILIES)}")


def spec(name: str, variant: str | None = None) -> FamilySpec:
    """The light facts of family `name` (imports no torch): of its `variant` where the family
    declares variants (the default one for None)."""
    _check(name)
    try:
        return importlib.import_module(FAMILIES[name][0]).SPEC.pick(variant)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def variant_specs(name: str) -> tuple[tuple[str | None, FamilySpec], ...]:
    """Every released kind of family `name` with its spec: ((variant, spec), ...); one entry
    (None, spec) for a family without variants."""
    _check(name)
    top = importlib.import_module(FAMILIES[name][0]).SPEC
    return top.variants or ((None, top),)


def get(name: str, variant: str | None = None) -> "Family":
    """A new object of the family registered under `name` (of its `variant`, where it has
    variants: the default one for None)."""
    spec(name, variant)
    module, cls = FAMILIES[name][1].rsplit(".", 1)
    family = getattr(importlib.import_module(module), cls)
    return family(variant) if variant is not None else family()


def resolve_variant(name: str, variant: str | None, folder: Path | None) -> str | None:
    """The variant a model config means: `variant` as given, else the one a diffusers folder's
    model_index.json declares (its pipeline class), else the family's default; None for a
    family without variants. Raises ValueError for an unknown variant, a folder whose pipeline
    is none of the family's, or a config naming another variant than its folder."""
    top = importlib.import_module(FAMILIES[name][0]).SPEC
    top.pick(variant)
    if not top.variants:
        return None
    index = folder / "model_index.json" if folder is not None else None
    declared = None
    if index is not None and index.is_file():
        try:
            pipeline = str(json.loads(index.read_text(encoding="utf-8")).get("_class_name"))
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"{index} cannot be read as JSON ({err}); it names the folder's "
                             "pipeline, which picks the variant") from None
        kinds = top.variants_of_pipeline(pipeline)
        # Variants sharing the folder's pipeline: the config's, where it names one of them.
        declared = variant if variant in kinds else next(iter(kinds), None)
        if declared is None:
            known = ", ".join(f"{s.pipeline_class} ({n})" for n, s in top.variants)
            raise ValueError(f"{index} names the pipeline {pipeline!r}, which is no variant of "
                             f"model.family = \"{name}\" (known: {known})")
    if variant is not None and declared is not None and variant != declared:
        raise ValueError(f"model.variant = {variant!r}, but the folder {folder} holds the "
                         f"{declared!r} variant (its model_index.json); set model.variant = "
                         f"{declared!r} or point model.path at a {variant!r} folder")
    return variant or declared or top.variants[0][0]
