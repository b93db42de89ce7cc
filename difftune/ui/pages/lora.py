"""The /lora page of one LoRA file: its inspect and verify reports, and convert and resize
in one click (the files land beside it; the run page lists them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from nicegui import run, ui

from difftune.ui import lora_file
from difftune.ui.context import UiContext
from difftune.ui.pages.layout import frame
from difftune.ui.security import PathOutsideRoots

_PROBLEMS = (PathOutsideRoots, lora_file.NotALora, lora_file.Refused)


def page_url(path: str) -> str:
    """The URL of a LoRA file's page."""
    return f"/lora?path={quote(path, safe='')}"


def register(ctx: UiContext) -> None:
    """Define the /lora page (`?path=` the file)."""

    @ui.page("/lora")
    async def lora_page(path: str = "") -> None:
        """The page of the LoRA file at `path` (under the roots)."""
        with frame(f"LoRA file {Path(path).name}"):
            await LoraView(ctx, path).draw()


class LoraView:
    """The reports and the actions of one file."""

    def __init__(self, ctx: UiContext, path: str) -> None:
        self.ctx, self.path = ctx, path

    async def draw(self) -> None:
        """Draw the actions and the report boxes, then fill the reports once the page is up
        (the first read builds the families' name tables: seconds, longer than a page may
        take to answer)."""
        with ui.row().classes("w-full items-center gap-2"):
            for to in ("comfy", "diffusers", "kohya"):
                ui.button(f"convert to {to}", on_click=self._action(
                    lora_file.convert_file, to)).props(f'flat data-testid="lora-convert-{to}"')
            rank = ui.number("rank", value=8, min=1, step=1).props('data-testid="lora-rank"')
            ui.button("resize", on_click=lambda: self._do(lora_file.resize, int(rank.value or 1),
                                                         None)) \
                .props('flat data-testid="lora-resize"')
        self.result = ui.label().classes("text-sm").props('data-testid="lora-result"')
        self.reports = ui.column().classes("w-full")
        with self.reports:
            ui.label("reading the file...")
        ui.timer(0.1, self._load, once=True)

    async def _load(self) -> None:
        """Read the reports off the event loop and show them (or why not)."""
        try:
            inspected, verified = await run.io_bound(lora_file.report_text, self.ctx.roots,
                                                     self.path)
        except _PROBLEMS as err:
            self.reports.clear()
            with self.reports:
                ui.label(str(err)).classes("text-negative").props('data-testid="lora-error"')
            return
        self.reports.clear()
        with self.reports:
            ui.label("inspect").classes("text-lg font-bold")
            ui.code(inspected).classes("w-full").props('data-testid="lora-inspect"')
            ui.label("verify").classes("text-lg font-bold")
            ui.code(verified).classes("w-full").props('data-testid="lora-verify"')

    def _action(self, call: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """A button's handler running `call(roots, path, *args)`."""
        return lambda: self._do(call, *args)

    async def _do(self, call: Callable[..., Any], *args: Any) -> None:
        """Run a tool off the event loop; show the file written or the refusal."""
        try:
            done = await run.io_bound(call, self.ctx.roots, self.path, *args)
        except _PROBLEMS as err:
            self.result.text = f"refused: {err}"
            self.result.classes(replace="text-sm text-negative")
            return
        self.result.text = f"wrote {self.ctx.roots.relative(Path(done['path']))}"
        self.result.classes(replace="text-sm text-positive")
