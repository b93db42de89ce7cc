"""The registry of model families: name -> (spec module, family class), imported lazily.

Adding a family is one folder under `families/` plus one line here. Config validation, the CLI
and the tests read the names and specs from here; `get` builds the family object (importing
torch and the model libraries only then).
"""

from __future__ import annotations

import importlib
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
    "krea2": ("difftune.families.krea2.spec", "difftune.families.krea2.family.Krea2Family"),
}


def names() -> tuple[str, ...]:
    """The registered family names, in registry order."""
    return tuple(FAMILIES)


def _check(name: str) -> None:
    """Refuse a name that is not registered, naming the choices."""
    if name not in FAMILIES:
        raise ConfigError(f"model.family = {name!r} is unknown; choose one of {sorted(FAMILIES)}")


def spec(name: str) -> FamilySpec:
    """The light facts of family `name` (imports no torch)."""
    _check(name)
    return importlib.import_module(FAMILIES[name][0]).SPEC


def get(name: str) -> "Family":
    """A new object of the family registered under `name`."""
    _check(name)
    module, cls = FAMILIES[name][1].rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)()
