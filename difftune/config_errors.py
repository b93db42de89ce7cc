"""Turning pydantic validation errors and `--set` overrides into plain, fixable messages."""

from __future__ import annotations

import tomllib
from typing import Any

from pydantic import ValidationError

from difftune.errors import ConfigError

_FIXES = {
    "extra_forbidden": "unknown key: remove it or check its spelling (see the README's config reference)",
    "missing": "required: add it",
    "literal_error": "choose one of the allowed values",
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


def format_validation_error(err: ValidationError, source: str) -> str:
    """One message listing every problem, each with its dotted field and a fix."""
    lines = [f"{source}: {err.error_count()} problem(s) in the configuration:"]
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        fix = _FIXES.get(e["type"])
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
