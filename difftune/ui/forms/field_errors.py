"""The CLI's validation message split by field, so the form shows each problem beside its input.

`difftune check` lists problems one per line as `  - <dotted.path>: <what and the fix>`
(`config.errors.format_validation_error`, `config.checks`). A line whose path names an input
the form shows (or an item of a list of tables, shown on that item's card) goes there; the rest
(the heading, problems of fields the form does not show) stay in the message at the top.
"""

from __future__ import annotations

import re
from collections.abc import Collection

_LINE = re.compile(r"^\s*-\s+([A-Za-z_][\w.\[\]]*):\s")
_SHORTHAND = re.compile(r"^(datasets\[\d+\])\.(?!subsets\[)")


def _placed(path: str, places: Collection[str]) -> str | None:
    """The place of `path` on the form: itself, or the same key of the dataset shorthand (a
    dataset's own `path` is its subset 0's)."""
    if path in places:
        return path
    shorthand = _SHORTHAND.sub(r"\1.subsets[0].", path)
    return shorthand if shorthand in places else None


def split(message: str | None, places: Collection[str]) -> tuple[dict[str, list[str]], str]:
    """`message`'s problem lines by the place they belong to (field paths and list items in
    `places`), and the text left for the top (empty when every problem found its place)."""
    by_place: dict[str, list[str]] = {}
    rest: list[str] = []
    for line in (message or "").splitlines():
        match = _LINE.match(line)
        place = _placed(match.group(1), places) if match else None
        if place is None:
            rest.append(line)
        else:
            by_place.setdefault(place, []).append(line.strip().removeprefix("- "))
    problems = [r for r in rest if _LINE.match(r)]
    if by_place and not problems:  # only the heading is left: nothing more to say at the top
        return by_place, ""
    return by_place, "\n".join(rest)
