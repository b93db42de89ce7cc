"""The run file as text, read and written with tomlkit so the CLI and the app share it byte for
byte: a file imported and exported unchanged is the same bytes; changing one field rewrites only
that value (comments, order and spacing stay); an exported file is what `difftune train` reads.

Form values are keyed by the dotted paths of `forms.schema` (`train.lr`,
`datasets[0].subsets[0].path`). A dataset written in the one-folder shorthand (`[[datasets]]`
with `path = ...`, no `[[datasets.subsets]]`) reads as its subset 0 and is written back in the
same shorthand. Paths stay as the user wrote them (relative to the file).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import AoT, Table, Whitespace
from tomlkit.toml_document import TOMLDocument

from difftune.errors import ConfigError
from difftune.ui.forms.schema import fields_by_path, template

_PART = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")
# Subset keys the DatasetConfig shorthand accepts on the dataset table itself (and the alias
# DreamBooth users know); derived from the models, as DatasetConfig derives it.
_SUBSET = "subsets[0]."
_ALIASES = {"prior_loss_weight": "loss_weight"}


def parse(text: str, source: str = "run.toml") -> TOMLDocument:
    """The document of `text`; bad TOML raises ConfigError worded as `load_config` words it."""
    try:
        tomllib.loads(text)  # the CLI's own parser decides what is valid
        return tomlkit.parse(text)
    except (tomllib.TOMLDecodeError, tomlkit.exceptions.TOMLKitError) as err:
        raise ConfigError(f"{source} is not valid TOML: {err}; fix the syntax at that place") \
            from None


def dumps(doc: TOMLDocument) -> str:
    """The document's text (its original bytes where nothing changed)."""
    return doc.as_string()


def plain(doc: TOMLDocument) -> dict[str, Any]:
    """The document as plain Python data (what `tomllib` gives `load_config`)."""
    return tomllib.loads(doc.as_string())


def _split(path: str) -> list[str | int]:
    """`datasets[0].subsets[1].path` -> ["datasets", 0, "subsets", 1, "path"]."""
    out: list[str | int] = []
    for name, indices in _PART.findall(path):
        out.append(name)
        out += [int(i) for i in re.findall(r"\d+", indices)]
    return out


def values(doc: TOMLDocument | dict[str, Any]) -> dict[str, Any]:
    """Every value the file sets, by form path (dataset shorthand read as subset 0)."""
    leaves = set(fields_by_path())
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            key = _ALIASES.get(key, key)
            path = f"{prefix}.{key}" if prefix else key
            shorthand = f"{prefix}.{_SUBSET}{key}"
            if prefix and re.fullmatch(r"datasets\[\d+\]", prefix) and \
                    template(shorthand) in leaves and template(path) not in leaves:
                path = shorthand
            if template(path) in leaves:
                out[path] = value
            elif isinstance(value, dict):
                walk(value, path)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for i, item in enumerate(value):
                    walk(item, f"{path}[{i}]")
            else:
                out[path] = value  # unknown to the form: validation names it

    walk(doc if isinstance(doc, dict) and not isinstance(doc, TOMLDocument) else plain(doc), "")
    return out


def _toml_value(value: Any) -> Any:
    """A form value as TOML can hold it (paths as text, tuples as arrays)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_toml_value(v) for v in value]
    if isinstance(value, list):
        return [_toml_value(v) for v in value]
    return value


def _new_table(parent: Any, key: str) -> Table:
    """A new, empty table `key` in `parent`."""
    parent[key] = tomlkit.table()
    return parent[key]


def _container(doc: TOMLDocument, parts: list[str | int], create: bool) -> Any:
    """The table holding the last part of `parts` (created on the way when `create`), or None.
    A dataset without `subsets` holds its subset 0's keys itself (the shorthand)."""
    node: Any = doc
    i = 0
    while i < len(parts) - 1:
        part, nxt = parts[i], parts[i + 1]
        if part == "subsets" and nxt == 0 and "subsets" not in node and "path" in node:
            i += 2  # the shorthand: the dataset table is its own subset 0
            continue
        if isinstance(part, int):
            if part < len(node):
                node = node[part]
            elif create and part == len(node):
                node.append(tomlkit.table())
                node = node[part]
            else:
                return None
        elif part in node:
            node = node[part]
        elif not create:
            return None
        elif isinstance(nxt, int):
            node[part] = AoT([])
            node = node[part]
        else:
            node = _new_table(node, part)
        i += 1
    return node


def set_value(doc: TOMLDocument, path: str, value: Any) -> None:
    """Set the field at `path` to `value` (None removes it); an equal value is left as written,
    so `1e-4` stays `1e-4`."""
    if value is None:
        remove_value(doc, path)
        return
    parts = _split(path)
    node = _container(doc, parts, create=True)
    fresh = isinstance(node, Table) and not node.value
    key = parts[-1]
    value = _toml_value(value)
    current = node.get(key) if hasattr(node, "get") else None
    if current is not None and _same(current, value):
        return
    _put(node, key, value)
    if fresh:  # a table made here ends with a blank line, as the tables around it do
        node.add(tomlkit.nl())


def _put(node: Any, key: str, value: Any) -> None:
    """`node[key] = value`, a new key going before the table's trailing blank lines (so it
    stays with the keys above them rather than with the next table's header)."""
    body = node.value.body if isinstance(node, Table) else None
    if key in node or not body or body[-1][0] is not None or \
            not isinstance(body[-1][1], Whitespace):
        node[key] = value
        return
    end = len(body)
    while end > 0 and body[end - 1][0] is None and isinstance(body[end - 1][1], Whitespace):
        end -= 1
    node.value._insert_at(end, key, tomlkit.item(value))


def _same(current: Any, value: Any) -> bool:
    """Whether a written value equals a new one (1 and 1.0 differ: the kind is kept)."""
    unwrapped = current.unwrap() if hasattr(current, "unwrap") else current
    return type(unwrapped) is type(value) and unwrapped == value


def remove_value(doc: TOMLDocument, path: str) -> None:
    """Remove the field at `path` where the file sets it (the default then applies)."""
    parts = _split(path)
    node = _container(doc, parts, create=False)
    if node is not None and parts[-1] in node:
        del node[parts[-1]]


def apply(text: str, changes: dict[str, Any], source: str = "run.toml") -> str:
    """`text` with each `path: value` of `changes` set (None removes it)."""
    doc = parse(text, source)
    for path, value in changes.items():
        set_value(doc, path, value)
    return dumps(doc)


def _subset_keys() -> set[str]:
    """The keys a dataset's one-folder shorthand holds for its subset 0."""
    return {p.removeprefix(f"datasets[0].{_SUBSET}") for p in fields_by_path()
            if p.startswith(f"datasets[0].{_SUBSET}")} | set(_ALIASES)


def _is_shorthand(node: Any, parts: list[str | int]) -> bool:
    """Whether `parts` names the `subsets` of a dataset written in the shorthand."""
    return parts[-1] == "subsets" and "subsets" not in node and "path" in node


def count(doc: TOMLDocument, path: str) -> int:
    """How many items the list of tables at `path` holds (a shorthand dataset: one subset)."""
    parts = _split(path)
    node = _container(doc, parts, create=False)
    if node is None:
        return 0
    if _is_shorthand(node, parts):
        return 1
    items = node.get(parts[-1]) if hasattr(node, "get") else None
    return len(items) if isinstance(items, (AoT, list)) else 0


def _expand_shorthand(node: Any) -> None:
    """Move a shorthand dataset's subset keys into an explicit `[[datasets.subsets]]` item."""
    keys = _subset_keys()
    first = tomlkit.table()
    for key in [k for k in node if k in keys]:
        first[key] = node[key]
        del node[key]
    node["subsets"] = AoT([first])


def add_item(doc: TOMLDocument, path: str) -> None:
    """Append an empty table to the list of tables at `path` (made when absent)."""
    parts = _split(path)
    node = _container(doc, parts, create=True)
    if _is_shorthand(node, parts):
        _expand_shorthand(node)
    key = parts[-1]
    if key not in node:
        node[key] = AoT([])
    node[key].append(tomlkit.table())


def remove_item(doc: TOMLDocument, path: str, index: int) -> None:
    """Remove item `index` of the list of tables at `path` (the list too when it empties)."""
    parts = _split(path)
    node = _container(doc, parts, create=False)
    if node is None:
        return
    if _is_shorthand(node, parts):
        for key in [k for k in node if k in _subset_keys()]:
            del node[key]
        return
    items = node.get(parts[-1])
    if isinstance(items, (AoT, list)) and index < len(items):
        del items[index]
        if not len(items):
            del node[parts[-1]]
