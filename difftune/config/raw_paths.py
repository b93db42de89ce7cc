"""The paths a run file names, found in its raw TOML (after `--set` overrides) before anything
is validated or opened: the web app checks them against its roots first, so a file it may not
serve is never read, stat'ed or described while the config loads (family detection reads
model headers, the checks ask whether files exist).

The path fields are found from the pydantic models' field types (a field whose type holds
`Path`, in every section, dataset and subset, a dataset's one-folder shorthand included), so a
path field added later is found without a list kept here; each is named as written (dotted,
list entries by index: datasets.0.path) and resolved as `load_config` resolves it.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from difftune.config.suggest import keys_of, model_in


def holds_path(annotation: Any) -> bool:
    """Whether a field's type is, or holds (through list[...], X | None), a Path."""
    if annotation is Path:
        return True
    origin = typing.get_origin(annotation)
    if origin not in (list, tuple, typing.Union, types.UnionType):
        return False
    return any(holds_path(arg) for arg in typing.get_args(annotation))


def _field(model: type[BaseModel], name: str) -> FieldInfo | None:
    """The field `name` of `model`, or of the model its shorthand stands for."""
    found = model.model_fields.get(name)
    shorthand = getattr(model, "shorthand_of", None)
    if found is None and shorthand is not None:
        return _field(shorthand, name)
    return found


def raw_paths(data: Any, model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key as written, raw text) of every path the raw mapping `data` of `model`
    names: string values of path-typed fields (a list of them entry by entry), in nested
    sections and tables. Values of another type are left to validation, which refuses them."""
    if not isinstance(data, dict):
        return
    names = keys_of(model)
    for key, value in data.items():
        field = _field(model, names[key]) if key in names else None
        if field is None:
            continue  # an unknown key: validation names it
        dotted = f"{prefix}.{key}" if prefix else str(key)
        section = model_in(field.annotation)
        if section is not None:
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                yield from raw_paths(item, section, dotted if i is None else f"{dotted}.{i}")
        elif holds_path(field.annotation):
            if isinstance(value, str):
                yield dotted, value
            elif isinstance(value, list):
                yield from ((f"{dotted}.{i}", v) for i, v in enumerate(value) if isinstance(v, str))


def resolved_against(value: str | Path, base: Path) -> Path:
    """A run file's path as `load_config` reads it: `~` expanded, a relative one taken from
    `base` (the run file's folder) and resolved."""
    path = Path(value)
    return path.expanduser() if path.is_absolute() else (base / path.expanduser()).resolve()
