"""Model families behind one protocol; `get(name)` returns the family object."""

from __future__ import annotations

from difftune.errors import ConfigError
from difftune.families.base import Components, Family, TextEmbeds, TextEncoderSpec


def _registry() -> dict[str, Family]:
    from difftune.families.flux import FluxFamily

    return {"flux": FluxFamily()}


def get(name: str) -> Family:
    """The family registered under `name`."""
    families = _registry()
    if name not in families:
        raise ConfigError(f"model.family = {name!r} is unknown; choose one of {sorted(families)}")
    return families[name]


__all__ = ["Components", "Family", "TextEmbeds", "TextEncoderSpec", "get"]
