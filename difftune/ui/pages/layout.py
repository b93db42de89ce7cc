"""The frame every page shares: header with navigation, then the page's content."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from nicegui import ui

NAV = (("Jobs", "/"), ("New run", "/prepare"), ("Datasets", "/datasets"),
       ("Compare", "/compare"), ("API", "/docs"))


@contextmanager
def frame(title: str) -> Iterator[ui.column]:
    """Open a page titled `title` under the common header; yields the content column."""
    ui.page_title(f"{title} · difftune")
    with ui.header().classes("items-center gap-4 py-2"):
        ui.label("difftune").classes("text-lg font-bold")
        for label, href in NAV:
            ui.link(label, href).classes("text-white no-underline")
    with ui.column().classes("w-full max-w-6xl mx-auto p-4 gap-4") as content:
        ui.label(title).classes("text-2xl").props('data-testid="page-title"')
        yield content


def error_box(message: str) -> ui.element:
    """An error shown as the CLI prints it (the message names the field or file and the fix)."""
    box = ui.card().classes("w-full bg-red-50 border border-red-300")
    with box:
        ui.label(message).classes("text-red-800 whitespace-pre-wrap font-mono text-sm") \
            .props('data-testid="error"')
    return box
