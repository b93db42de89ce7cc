"""Model families behind one protocol; `get(name)` returns the family object."""

from __future__ import annotations

import importlib

from difftune.errors import ConfigError
from difftune.families.base import (Components, Conditioning, Family, ModelSpec, TextEmbeds,
                                    TextEncoderSpec)

# name -> (module, class); modules are imported only when their family is used.
_FAMILIES: dict[str, tuple[str, str]] = {
    "flux": ("difftune.families.flux", "FluxFamily"),
    "sd3": ("difftune.families.sd3", "SD3Family"),
    "sdxl": ("difftune.families.sdxl", "SDXLFamily"),
}


def names() -> tuple[str, ...]:
    """Every registered family name, in registry order (what tests parametrize over)."""
    return tuple(_FAMILIES)


def get(name: str) -> Family:
    """The family registered under `name`."""
    if name not in _FAMILIES:
        raise ConfigError(f"model.family = {name!r} is unknown; choose one of {sorted(_FAMILIES)}")
    module, cls = _FAMILIES[name]
    return getattr(importlib.import_module(module), cls)()


__all__ = ["Components", "Conditioning", "Family", "ModelSpec", "TextEmbeds", "TextEncoderSpec",
           "get", "names"]
