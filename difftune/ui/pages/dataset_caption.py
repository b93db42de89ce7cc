"""The datasets page's "Caption" and "Report" panels.

Caption runs `difftune caption` on the open folder in the background (ui/captioning.py): the
page polls its state once a second, showing the count, images/s, time left and the newest
captions; Stop keeps every caption written, and Start again continues where it stopped.
Report shows `difftune dataset report`'s findings, each with its image (a link to it).
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from nicegui import run, ui

from difftune.errors import DifftuneError
from difftune.ui import captioning
from difftune.ui.context import UiContext
from difftune.ui.pages.layout import error_box
from difftune.ui.security import PathOutsideRoots

Folder = Callable[[], Path | None]


def _image_link(path: str, size: int = 96) -> str:
    """A thumbnail of `path` linking to the whole image (both through the roots check)."""
    src = f"/api/datasets/image?path={quote(path, safe='')}"
    return (f'<a href="{src}" target="_blank" title="{escape(Path(path).name)}">'
            f'<img src="{src}&amp;size={size}" style="max-height:{size}px"></a>')


class CaptionPanel:
    """Model, style, prompt and trigger fields; Start and Stop; progress and recent captions."""

    def __init__(self, ctx: UiContext, folder: Folder, on_done: Callable) -> None:
        self.ctx, self.folder, self.on_done = ctx, folder, on_done
        self.last_state = "idle"
        with ui.expansion("Caption with a local model").classes("w-full") \
                .props('data-testid="caption-panel"'):
            with ui.row().classes("w-full items-end gap-3"):
                self.found = ui.select({}, label="Captioners found", on_change=self._picked) \
                    .classes("w-72").props('data-testid="caption-found"')
                self.model = ui.input("Captioning model folder (under the roots)") \
                    .classes("grow").props('data-testid="caption-model"')
                self.style = ui.select(list(captioning.STYLES), value="short", label="Style") \
                    .classes("w-32").props('data-testid="caption-style"')
                self.trigger = ui.input("Trigger word").classes("w-32") \
                    .props('data-testid="caption-trigger"')
            self.prompt = ui.input("Prompt (style: prompt)").classes("w-full") \
                .props('data-testid="caption-prompt"')
            with ui.row().classes("items-center gap-2"):
                self.start_button = ui.button("Start", icon="play_arrow", on_click=self.start) \
                    .props('data-testid="caption-start"')
                self.stop_button = ui.button("Stop", icon="stop", on_click=self.stop) \
                    .props('flat data-testid="caption-stop"')
                self.stop_button.set_enabled(False)
                self.state = ui.label("").props('data-testid="caption-state"')
            self.recent = ui.column().classes("w-full gap-1").props('data-testid="caption-recent"')
        ui.timer(1.0, self.refresh)
        ui.timer(0.2, self._load_models, once=True)

    async def _load_models(self) -> None:
        """Fill the picker with the captioners under the roots (a walk, off the event loop)."""
        found = await run.io_bound(captioning.captioners_under, list(self.ctx.roots.folders))
        self.found.set_options({f["path"]: f"{self.ctx.roots.relative(Path(f['path']))} "
                                           f"({f['kind']})" for f in found})

    def _picked(self, event: Any) -> None:
        if event.value:
            self.model.set_value(event.value)

    async def start(self) -> None:
        """Start captioning the open folder (an error shown for a path outside the roots)."""
        folder = self.folder()
        if folder is None:
            self.state.set_text("open a folder of images first")
            return
        try:
            await run.io_bound(captioning.start_under, self.ctx.roots, str(folder),
                               (self.model.value or "").strip(), self.style.value,
                               self.prompt.value or "", self.trigger.value or "")
        except (PathOutsideRoots, ValueError, OSError, DifftuneError) as err:
            self.state.set_text(f"cannot start: {err}")
            return
        self.state.set_text("starting ...")

    async def stop(self) -> None:
        """Ask the captioning to stop after its batch."""
        folder = self.folder()
        if folder is not None and await run.io_bound(captioning.stop, self.ctx.state_dir,
                                                     folder):
            self.state.set_text("stopping ...")

    async def refresh(self) -> None:
        """Show the captioning's state; when it ends, refresh the page's images."""
        folder = self.folder()
        if folder is None:
            return
        st = await run.io_bound(captioning.status, self.ctx.state_dir, folder)
        self.start_button.set_enabled(st.state != "running")
        self.stop_button.set_enabled(st.state == "running")
        if st.state == "idle":
            return
        total = f" of {st.total}" if st.total is not None else ""
        speed = (f" · {st.rate:.2f} images/s · {st.eta_s:.0f} s left"
                 if st.rate is not None and st.eta_s is not None else "")
        words = {"running": "captioning", "finished": "finished", "stopped":
                 "stopped (Start continues)", "failed": f"failed: {st.error}"}
        self.state.set_text(f"{words[st.state]}: {st.done}{total} captions written{speed}")
        self.recent.clear()
        with self.recent:
            for r in st.recent:
                with ui.row().classes("items-center gap-2"):
                    ui.html(_image_link(r["image"], 48))
                    ui.label(r["caption"]).classes("text-sm")
        if self.last_state == "running" and st.state != "running":
            await self.on_done()
        self.last_state = st.state


class FindingsPanel:
    """The "Report" button and the dataset report's findings, each with its image."""

    def __init__(self, ctx: UiContext, source: Callable[[], Path | None],
                 resolution: Callable[[], int]) -> None:
        self.ctx, self.source, self.resolution = ctx, source, resolution
        with ui.row().classes("items-center gap-2"):
            ui.label("Dataset report").classes("text-xl")
            ui.button("Report", icon="fact_check", on_click=self.show) \
                .props('flat data-testid="findings-run"')
        self.box = ui.column().classes("w-full gap-1").props('data-testid="findings"')

    async def show(self) -> None:
        """Compute the report (off the event loop) and list its findings."""
        from difftune.dataset_report.render import summary_line

        self.box.clear()
        source = self.source()
        if source is None:
            return
        try:
            report = await run.io_bound(captioning.findings, source, self.resolution(),
                                          self.ctx.roots)
        except (DifftuneError, ValueError, OSError) as err:
            with self.box:
                error_box(str(err))
            return
        with self.box:
            ui.label(summary_line(report)).props('data-testid="findings-summary"')
            for n, f in enumerate(report.findings):
                inside = self.ctx.roots.relative(Path(f.image))
                with ui.row().classes("items-center gap-3") \
                        .props(f'data-testid="finding-{n}"'):
                    ui.html(_image_link(f.image) + (_image_link(f.other) if f.other else ""))
                    ui.label(f"{f.check}: {inside}: {f.detail}").classes("text-sm")
