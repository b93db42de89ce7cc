"""An import's outputs: the run file as TOML (each key commented with where it came from, what
was left out listed at the top) and the report printed line by line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import AoT, Table

from difftune.importers.notes import Note, Translation

SECTIONS = ("model", "precision", "adapter", "datasets", "cache", "train", "preservation",
            "validation", "sample", "save")
HEADINGS = {"maps": "maps", "guessed": "guessed (check these)",
            "built in": "built in (difftune does this already)",
            "no equivalent": "no equivalent (left out)",
            "unknown": "unknown to this importer (left out)"}


def _table(t: Translation, node: dict[str, Any], where: str) -> Table:
    """A TOML table of `node`, each key with its trailing comment."""
    table = tomlkit.table()
    for key, value in node.items():
        dotted = f"{where}.{key}"
        if isinstance(value, dict):
            table.add(key, _table(t, value, dotted))
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            table.add(key, _aot(t, value, dotted))
            continue
        item = tomlkit.item(value)
        if dotted in t.comments:
            item.comment(t.comments[dotted])
        table.add(key, item)
    return table


def _aot(t: Translation, items: list[dict[str, Any]], where: str) -> AoT:
    """An array of tables ([[datasets]], [[datasets.subsets]])."""
    aot = tomlkit.aot()
    for i, entry in enumerate(items):
        aot.append(_table(t, entry, f"{where}.{i}"))
    return aot


def run_toml(t: Translation, source: Path, command: str, todo: list[str]) -> str:
    """The run file's text; `todo` lists what difftune's checks still refuse."""
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"difftune run file imported from {source} ({t.trainer})"))
    doc.add(tomlkit.comment(f"by `{command}`. Check it with `difftune check <this file>`."))
    left = [n for n in t.notes if n.kind in ("no equivalent", "unknown")]
    if left:
        doc.add(tomlkit.comment("Left out (no equivalent in difftune, or unknown here):"))
        for note in left:
            doc.add(tomlkit.comment(f"  {note.source}: {note.why}"))
    if todo:
        doc.add(tomlkit.comment("To fix before it trains (difftune's own checks):"))
        for line in todo:
            doc.add(tomlkit.comment(line))
    doc.add(tomlkit.nl())
    for name in SECTIONS:
        value = t.data.get(name)
        if isinstance(value, list):
            doc.add(name, _aot(t, value, name))
        elif isinstance(value, dict):
            doc.add(name, _table(t, value, name))
    return tomlkit.dumps(doc)


def report(notes: list[Note]) -> list[str]:
    """The report: notes grouped by kind; left-out keys sharing a reason on one line."""
    lines = []
    for kind, heading in HEADINGS.items():
        group = [n for n in notes if n.kind == kind]
        if not group:
            continue
        lines.append(f"{heading}:")
        if kind in ("maps", "guessed"):
            lines += [f"  {n.source}  ->  {n.target}" + (f"  ({n.why})" if n.why else "")
                      for n in group]
            continue
        reasons: dict[str, list[str]] = {}
        for n in group:
            reasons.setdefault(n.why, []).append(n.source)
        lines += [f"  {', '.join(sources)}: {why}" for why, sources in reasons.items()]
    return lines
