"""Families live in their folders: no module outside `difftune/families/<name>/` (and the
registry that lists them) names a registered family in a string, so core and shared code
cannot branch on a family's name, and adding a family touches only its folder, the registry
and shared code that became more general."""

from __future__ import annotations

import ast
from pathlib import Path

import difftune
from difftune.families import registry

ROOT = Path(difftune.__file__).parent
ALLOWED = {ROOT / "families" / "registry.py"}
# (module, name) pairs that are data, not branches: the config's default family, and the
# kohya_ss GUI's `sdxl` config key (a key name the kohya importer reads).
DEFAULTS = {("config/sections.py", "flux"), ("importers/kohya_script.py", "sdxl")}


def _strings(path: Path) -> set[str]:
    """Every string constant in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def test_no_family_name_outside_its_folder() -> None:
    names = set(registry.names())
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path in ALLOWED or (rel.parts[0] == "families" and rel.parts[1] in names):
            continue
        found += [f"{rel}: {s!r}" for s in sorted(_strings(path) & names)
                  if (rel.as_posix(), s) not in DEFAULTS]
    assert not found, "family names outside their folders:\n" + "\n".join(found)
