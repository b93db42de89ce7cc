"""Model families behind one protocol; `get(name)` returns the family object.

Importing this package imports no torch: the registry and the specs are light, and a family's
heavy modules are imported when `get` builds it. The protocol and the data passed between the
parts of a run are in `difftune.families.base`.
"""

from __future__ import annotations

from difftune.families.registry import get, names, spec

__all__ = ["get", "names", "spec"]
