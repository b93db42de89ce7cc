"""The model picker of the new-run form: a dialog listing the model folders and files under
the roots (`ui.models.scan`, run off the event loop), each with the family (and variant) its
files tell; choosing one writes its `model` lines into the run file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from nicegui import run, ui

from difftune.ui import models
from difftune.ui.context import UiContext

Pick = Callable[[dict[str, Any]], None]


class ModelPicker:
    """The "Find models" button and its dialog; `on_pick` gets the chosen model's fields."""

    def __init__(self, ctx: UiContext, on_pick: Pick) -> None:
        self.ctx, self.on_pick = ctx, on_pick
        with ui.dialog() as self.dialog, ui.card().classes("min-w-[48rem]"):
            ui.label("Models under the roots").classes("text-lg")
            ui.label("Recognised from model_index.json or the tensors a file holds, never "
                     "from its name.").classes("text-sm text-gray-600")
            self.state = ui.label("").props('data-testid="models-state"')
            self.rows = ui.column().classes("w-full gap-1")
        ui.button("Find models", icon="search", on_click=self.open) \
            .props('flat data-testid="find-models"')

    async def open(self) -> None:
        """Show the dialog and scan the roots (bounded) off the event loop."""
        self.dialog.open()
        self.rows.clear()
        self.state.text = "scanning…"
        found = await run.io_bound(models.scan, self.ctx.roots)
        if found is None:
            return  # the page was closed
        self.state.text = f"{len(found)} found" if found else \
            "no model folder or .safetensors file under the roots"
        with self.rows:
            for i, item in enumerate(found):
                self._row(i, item)

    def _row(self, i: int, item: models.Found) -> None:
        """One model's row: its path under its root, what it is, why, and "Use" if known."""
        what = item.family if item.variant is None else f"{item.family} ({item.variant})"
        with ui.row().classes("w-full items-center no-wrap gap-2") \
                .props(f'data-testid="model-{i}"'):
            ui.label(self.ctx.roots.relative(Path(item.path))).classes("font-mono text-sm grow") \
                .props(f'data-testid="model-{i}-path"')
            ui.label(f"{item.kind} · {what}").props(f'data-testid="model-{i}-family"')
            ui.label(item.why).classes("text-xs text-gray-600")
            if item.fields:
                ui.button("Use", on_click=lambda f=item.fields: self.use(f)) \
                    .props(f'dense data-testid="model-{i}-use"')

    def use(self, fields: dict[str, Any]) -> None:
        """Write the chosen model's lines and close the dialog."""
        self.dialog.close()
        self.on_pick(fields)

