"""The inputs of the new-run form: one `FieldInput` per field (a human label with its dotted
key shown small, the help under it, its own problems under that), and `ItemList`, which
repeats a list of tables' fields (`[[datasets]]`, `[[datasets.subsets]]`,
`[[adapter.embeddings]]`) once per item the file holds, with buttons to add and remove items.
"""

from __future__ import annotations

import tomllib
from typing import Any, Callable

from nicegui import ui

from difftune.ui.forms.schema import FieldSpec

Changed = Callable[[str, Any], None]


def _literal(text: str) -> Any:
    """A TOML literal typed in a text field (an array, a table, a number), else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _shown(value: Any) -> str:
    """A value as TOML writes it (for list, table and free-value inputs)."""
    if value is None:
        return ""
    import tomlkit

    return tomlkit.item(value).as_string()


def _attr(text: str) -> str:
    """Text safe inside a double-quoted prop."""
    return text.replace('"', "'")


def problems_label(testid: str) -> ui.label:
    """The place a field's (or an item's) problems are shown, empty until there are some."""
    return ui.label("").classes("text-sm text-red-800 whitespace-pre-wrap") \
        .props(f'data-testid="{testid}"')


class FieldInput:
    """One form input bound to a concrete field path (`datasets[1].subsets[0].path`): the
    widget, its label and key, its help, its problems, and value conversions."""

    def __init__(self, spec: FieldSpec, path: str, on_change: Changed) -> None:
        self.spec, self.path = spec, path
        with ui.column().classes("w-full gap-0") as self.row:
            with ui.row().classes("w-full items-baseline gap-2"):
                ui.label(spec.label or spec.name).classes("text-sm font-medium") \
                    .props(f'data-testid="label-{path}"')
                ui.label(spec.path.split(".")[-1] if spec.repeated else path) \
                    .classes("text-xs font-mono text-gray-500").props(f'data-testid="key-{path}"')
            self.widget = self._make(on_change)
            self.widget.classes("w-full").props(f'data-testid="field-{path}"')
            if spec.help:
                ui.label(spec.help).classes("text-xs text-gray-600") \
                    .props(f'data-testid="help-{path}"')
            self.problems = problems_label(f"problem-{path}")

    def _make(self, on_change: Changed) -> ui.element:
        """The widget of the field's kind (the default, or "required"/"unset", as its hint)."""
        s = self.spec
        hint = f"default: {_shown(s.default)}" if s.default is not None else \
            ("required" if s.required else "unset")
        handler = lambda e: on_change(self.path, self.read(e.value))  # noqa: E731
        if s.kind == "bool":
            return ui.switch(value=bool(s.default), on_change=handler)
        if s.kind in ("int", "float"):
            bounds = {k: v for k, v in (("min", s.bounds.get("ge")), ("max", s.bounds.get("le")))
                      if v is not None}
            return ui.number(on_change=handler, step=1 if s.kind == "int" else None,
                             **bounds).props(f'dense clearable hint="{hint}"')
        if s.kind == "choice" and s.choices is not None:
            options = {c: _shown(c).strip('"') for c in s.choices}
            return ui.select(options, value=None, on_change=handler,
                             clearable=True).props(f'dense hint="{_attr(hint)}"')
        if s.kind == "list" and s.choices:
            return ui.select({c: str(c) for c in s.choices}, multiple=True,
                             value=[], on_change=handler).props(f'dense hint="{_attr(hint)}"')
        return ui.input(on_change=handler).props(f'dense clearable hint="{_attr(hint)}"')

    def read(self, value: Any) -> Any:
        """The widget's value as the TOML value to write (None: unset the field)."""
        kind = self.spec.kind
        if value in (None, "") or (kind == "list" and value == [] and self.spec.choices):
            return None
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind in ("list", "table", "value") and isinstance(value, str):
            return _literal(value)
        return value

    def show(self, value: Any) -> None:
        """Put `value` (None: the default) into the widget, without reporting a change."""
        s, w = self.spec, self.widget
        if s.kind == "bool":
            w.value = bool(s.default if value is None else value)
        elif s.kind in ("int", "float"):
            w.value = value if isinstance(value, (int, float)) else None
        elif s.kind == "choice" and s.choices is not None:
            w.value = value if value in s.choices else None
        elif s.kind == "list" and s.choices:
            w.value = [v for v in value or [] if v in s.choices]
        elif s.kind in ("list", "table", "value"):
            w.value = _shown(value) if value is not None else ""
        else:
            w.value = "" if value is None else str(value)

    def show_problems(self, lines: list[str]) -> None:
        """Show this field's problems under it (none: nothing)."""
        self.problems.text = "\n".join(lines)
