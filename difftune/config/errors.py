"""Turning pydantic validation errors and `--set` overrides into plain, fixable messages."""

from __future__ import annotations

import tomllib
from typing import Any

from pydantic import BaseModel, ValidationError

from difftune.config.suggest import did_you_mean
from difftune.errors import ConfigError

_FIXES = {
    "extra_forbidden": "unknown key: remove it or check its spelling (see the README's config reference)",
    "missing": "required: add it",
    "literal_error": "choose one of the allowed values",
    "finite_number": "write a finite number (inf and nan are not values this field can take)",
}
# Required sections and fields, with what to write (an empty file lists them all at once).
_MISSING = {
    "model": 'add a [model] section: flavor = "tiny", path = a diffusers folder, or single files',
    "datasets": "add a [[datasets]] table with path = a folder of images and captions",
    "save": "add a [save] section with dir = the output folder",
    "save.dir": "add dir = the output folder",
}
# Keys that are not options, with what to use instead.
_NOT_OPTIONS = {
    "sample.keep_last": "not an option: samples are never deleted (nothing a run made is "
                        "removed); to keep only the K newest checkpoints use save.keep_last",
}


def _dotted(loc: tuple[Any, ...]) -> str:
    """`('datasets', 0, 'subsets', 1, 'path')` -> `datasets[0].subsets[1].path`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "tagged-union")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fix(kind: str, loc: tuple[Any, ...], root: type[BaseModel] | None) -> str | None:
    """What to do about one problem: the field's own advice where it has some, else its kind's
    (for an unknown key, the known key it most likely meant)."""
    where = _dotted(loc)
    if kind == "missing" and where in _MISSING:
        return _MISSING[where]
    if kind == "extra_forbidden" and where in _NOT_OPTIONS:
        return _NOT_OPTIONS[where]
    if kind == "extra_forbidden" and root is not None:
        guess = did_you_mean(root, loc, _dotted(loc[:-1]) if len(loc) > 1 else "")
        if guess:
            return f"unknown key: {guess}"
    return _FIXES.get(kind)


def format_validation_error(err: ValidationError, source: str,
                            root: type[BaseModel] | None = None) -> str:
    """One message listing every problem, each with its dotted field and a fix; `root`, the
    model validated, lets an unknown key be answered with the key it most likely meant."""
    lines = [f"{source}: {err.error_count()} problem(s) in the configuration:"]
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        fix = _fix(e["type"], e["loc"], root)
        if e["type"] not in ("missing", "extra_forbidden", "value_error") and "input" in e:
            msg += f" (got {e['input']!r})"
        lines.append(f"  - {_dotted(e['loc'])}: {msg}" + (f" — {fix}" if fix else ""))
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    """A TOML literal (number, bool, string, array, inline table); else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(data: dict[str, Any], item: str) -> None:
    """Apply one `a.b.c=value` override to the raw config mapping (lists by index: datasets.0.path)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, for example --set train.lr=2e-4")
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"--set {item!r}: {'.'.join(parts[:i])} has {len(node)} entries; "
                    f"use an index from 0 to {len(node) - 1}"
                )
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"--set {item!r}: index {last} is out of range")
        node[int(last)] = _parse_value(text)
    else:
        node[last] = _parse_value(text)
