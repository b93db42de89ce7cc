"""The new-run form's layout: one expansion per section of the run file, each field an input
(`form_fields.FieldInput`) at its concrete path, and every list of tables repeated once per item
the file holds (`ItemList`: a card per dataset, subset and embedding, with add and remove).

The form follows the file: `sync` rebuilds a list whose item count changed (an item added,
removed, or written in the TOML view), `show` puts the values in and hides the fields that do
not apply, and `show_problems` puts each validation problem beside the input it names.
"""

from __future__ import annotations

from typing import Any, Callable

from nicegui import ui
from tomlkit.toml_document import TOMLDocument

from difftune.ui.forms import field_errors, schema, toml_io
from difftune.ui.forms.schema import FieldSpec
from difftune.ui.pages.form_fields import Changed, FieldInput, problems_label

Subs = list[tuple[str, str]]  # (template item prefix, concrete item prefix), innermost first


def concrete(path: str, subs: Subs) -> str:
    """The template `path` (`datasets[0].subsets[0].path`) at the items `subs` name."""
    for tmpl, conc in subs:
        if path == tmpl or path.startswith(tmpl + ".") or path.startswith(tmpl + "["):
            return conc + path[len(tmpl):]
    return path


def _children(owner: str | None, specs: list[FieldSpec]) -> list[str]:
    """The lists of tables directly inside `owner` (a list's template path; None: a section)."""
    inner = {s.repeated for s in specs if s.repeated and s.repeated != owner}
    return [r for r in inner if not any(r != o and r.startswith(o + "[0].") for o in inner)]


class Form:
    """Every input of the form by concrete path, and the places item problems show."""

    def __init__(self, on_change: Changed, on_add: Callable[[str], None],
                 on_remove: Callable[[str, int], None]) -> None:
        self.on_change, self.on_add, self.on_remove = on_change, on_add, on_remove
        self.inputs: dict[str, FieldInput] = {}
        self.items: dict[str, ui.label] = {}  # an item's concrete path -> its problems
        self.lists: list[ItemList] = []
        self.hidden: set[str] = set()  # inputs hidden (their problems then stay at the top)

    def build(self) -> None:
        """One expansion per section, the model and datasets open."""
        for section in schema.sections():
            with ui.expansion(section.title, value=section.name in ("model", "datasets")) \
                    .classes("w-full").props(f'data-testid="section-{section.name}"'):
                if section.help:
                    ui.label(section.help).classes("text-sm text-gray-600")
                self.fields(section.fields, None, [])

    def fields(self, specs: list[FieldSpec], owner: str | None, subs: Subs) -> None:
        """Lay out `specs` (the fields of `owner`'s item, or of a section), each list of
        tables inside them where its first field falls."""
        children, placed = _children(owner, specs), set()
        for spec in specs:
            if spec.repeated == owner:
                path = concrete(spec.path, subs)
                self.inputs[path] = FieldInput(spec, path, self.on_change)
                continue
            child = next(c for c in children if spec.path.startswith(c + "[0]"))
            if child not in placed:
                placed.add(child)
                inner = [s for s in specs if s.path.startswith(child + "[0]")]
                made = ItemList(self, child, inner, subs)  # may forget lists: then append
                self.lists.append(made)

    def forget(self, prefix: str) -> None:
        """Drop the inputs, item places and lists under concrete list path `prefix`."""
        for table in (self.inputs, self.items):
            for path in [p for p in table if p.startswith(prefix + "[")]:
                del table[path]
        self.lists = [lst for lst in self.lists if not lst.conc.startswith(prefix + "[")]

    def sync(self, doc: TOMLDocument) -> None:
        """Rebuild each list whose item count differs from the file's."""
        for lst in list(self.lists):
            if lst in self.lists:
                lst.sync(doc)

    def show(self, values: dict[str, Any], hidden: dict[str, str]) -> None:
        """Put `values` into the inputs; hide the fields that do not apply."""
        self.hidden = {p for p in self.inputs if schema.template(p) in hidden}
        for path, field in self.inputs.items():
            field.show(values.get(path))
            field.row.set_visibility(path not in self.hidden)

    def show_problems(self, message: str | None) -> str:
        """Put each problem of `message` beside its input or item (a hidden input's stays in
        the rest); the rest is returned."""
        places = (set(self.inputs) - self.hidden) | set(self.items)
        by_place, rest = field_errors.split(message, places)
        for path, field in self.inputs.items():
            field.show_problems(by_place.get(path, []))
        for path, place in self.items.items():
            place.text = "\n".join(by_place.get(path, []))
        return rest


class ItemList:
    """The items of one list of tables at its concrete path, each a card, with add/remove."""

    def __init__(self, form: Form, tmpl: str, specs: list[FieldSpec], subs: Subs) -> None:
        self.form, self.tmpl, self.specs, self.subs = form, tmpl, specs, subs
        self.conc = concrete(tmpl, subs)
        self.name = tmpl.rsplit(".", 1)[-1].removesuffix("s")
        self.count = 1
        with ui.column().classes("w-full gap-2") as self.box:
            self.render()

    def render(self) -> None:
        """The cards of the items, then the add button."""
        self.box.clear()
        self.form.forget(self.conc)
        with self.box:
            for i in range(self.count):
                self._item(i)
            ui.button(f"Add {self.name}", icon="add",
                      on_click=lambda: self.form.on_add(self.conc)) \
                .props(f'flat dense data-testid="add-{self.conc}"')

    def _item(self, i: int) -> None:
        """Item `i`'s card: its title and path, remove button, problems and fields."""
        item = f"{self.conc}[{i}]"
        with ui.card().classes("w-full p-2 gap-1").props(f'data-testid="item-{item}"'):
            with ui.row().classes("w-full items-center"):
                ui.label(f"{self.name.capitalize()} {i + 1}").classes("font-medium")
                ui.label(item).classes("text-xs font-mono text-gray-500")
                ui.space()
                ui.button(icon="delete", on_click=lambda i=i: self.form.on_remove(self.conc, i)) \
                    .props(f'flat dense round data-testid="remove-{item}"') \
                    .tooltip(f"remove {item}")
            self.form.items[item] = problems_label(f"problem-{item}")
            self.form.fields(self.specs, self.tmpl, [(f"{self.tmpl}[0]", item)] + self.subs)

    def sync(self, doc: TOMLDocument) -> None:
        """Rebuild when the file holds another number of items."""
        count = toml_io.count(doc, self.conc)
        if count != self.count:
            self.count = count
            self.render()
