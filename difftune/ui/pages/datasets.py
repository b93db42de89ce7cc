"""The /datasets page: pick a folder of images, see them with their captions and edit a caption
in place, and see what training would make of the folder (buckets, the images `check` would
skip and why, tags by frequency, caption lengths).

The page calls the functions the /api/datasets routes call (difftune/ui/datasets.py); images
are shown through /api/datasets/image, so they pass the same roots check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from nicegui import run, ui

from difftune.errors import DifftuneError
from difftune.ui import datasets
from difftune.ui.context import UiContext
from difftune.ui.pages.dataset_caption import CaptionPanel, FindingsPanel
from difftune.ui.pages.dataset_tools import DatasetTools
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.security import PathOutsideRoots

PAGE_SIZE = 24
TOP_TAGS = 40


def image_url(path: str, size: int = 256) -> str:
    """The URL of a dataset image's thumbnail (through the API's roots check)."""
    return f"/api/datasets/image?path={quote(path, safe='')}&size={size}"


def register(ctx: UiContext) -> None:
    """Define the /datasets page (`?path=` a folder or run file, `resolution=`, `offset=`)."""

    @ui.page("/datasets")
    async def datasets_page(path: str = "", resolution: int = 1024, offset: int = 0) -> None:
        with frame("Datasets"):
            view = DatasetView(ctx, path, resolution)
            if path:  # after the page is sent: the first browse imports the data code (slow)
                ui.timer(0.05, lambda: view.open(offset), once=True)


class DatasetView:
    """The page's parts and what each control does."""

    def __init__(self, ctx: UiContext, path: str, resolution: int) -> None:
        self.ctx, self.offset = ctx, 0
        self.folder: Path | None = None  # the folder open (None: none, or a run file)
        with ui.row().classes("w-full items-end gap-4"):
            self.picker = ui.select({}, label="Folders with images", with_input=True,
                                    on_change=self._picked).classes("w-96") \
                .props('data-testid="folder-select"')
            self.path = ui.input("Folder or run file", value=path).classes("grow") \
                .props('data-testid="folder-path"').on("keydown.enter", lambda: self.open(0))
            self.resolution = ui.number("Resolution", value=resolution, min=64, step=64,
                                        precision=0).classes("w-32") \
                .props('data-testid="resolution"')
            ui.button("Open", on_click=lambda: self.open(0)).props('data-testid="open-folder"')
        self.tools = DatasetTools(ctx, lambda: self.folder, lambda: self.open(self.offset))
        CaptionPanel(ctx, lambda: self.folder, lambda: self.open(self.offset))
        self.errors = ui.column().classes("w-full")
        self.status = ui.label("").props('data-testid="dataset-status"')
        self.grid = ui.grid(columns=4).classes("w-full gap-3").props('data-testid="image-grid"')
        with ui.row().classes("items-center gap-2"):
            self.prev = ui.button("Previous", on_click=lambda: self.open(self.offset - PAGE_SIZE)) \
                .props('flat data-testid="prev-page"')
            self.page_info = ui.label("").props('data-testid="page-info"')
            self.next = ui.button("Next", on_click=lambda: self.open(self.offset + PAGE_SIZE)) \
                .props('flat data-testid="next-page"')
        with ui.row().classes("items-center gap-2"):
            ui.label("What training would make of it").classes("text-xl")
            ui.button("Refresh report", on_click=self.show_report) \
                .props('flat data-testid="refresh-report"')
        self.report = ui.column().classes("w-full gap-4").props('data-testid="dataset-report"')
        FindingsPanel(ctx, self._source, lambda: int(self.resolution.value or 1024))
        ui.timer(0.1, self._load_folders, once=True)

    async def _load_folders(self) -> None:
        """Fill the folder picker (a walk of the roots, off the event loop)."""
        found = await run.io_bound(datasets.image_folders, list(self.ctx.roots.folders))
        self.picker.set_options({f["path"]: f"{self.ctx.roots.relative(Path(f['path']))} "
                                            f"({f['images']} images)" for f in found})

    async def _picked(self, event: Any) -> None:
        if event.value:
            self.path.set_value(event.value)
            await self.open(0)

    def _error(self, message: str) -> None:
        with self.errors:
            error_box(message)

    def _source(self) -> Path | None:
        """The path typed, resolved under the roots (an error shown when it is outside)."""
        self.errors.clear()
        try:
            return self.ctx.roots.resolve((self.path.value or "").strip() or ".")
        except PathOutsideRoots as err:
            self._error(str(err))
            return None

    async def open(self, offset: int) -> None:
        """Show a page of the folder's images from `offset`, then its report."""
        source = self._source()
        self.grid.clear()
        self.report.clear()
        if source is None:
            return
        if source != self.folder:
            self.tools.selected.clear()
        self.folder = source if source.is_dir() else None
        await self.tools.refresh_undo()
        if source.is_dir():
            self.offset = max(0, offset)
            await self._show_page(source)
        elif source.is_file():
            self.status.set_text(f"run file {source}: the report of its datasets")
            self.page_info.set_text("")
        else:
            self._error(f"{source} does not exist; pick a folder of images or a run file")
            return
        await self.show_report()

    async def _show_page(self, folder: Path) -> None:
        """Render one page of images with editable captions."""
        page = await run.io_bound(datasets.browse, folder, self.offset, PAGE_SIZE,
                                  inside=datasets.under(self.ctx.roots))
        without = sum(1 for i in page.items if i.caption is None)
        self.status.set_text(f"{page.total} images in {folder}")
        last = min(page.offset + len(page.items), page.total)
        self.page_info.set_text(f"{page.offset + 1 if page.items else 0}–{last} of {page.total}"
                                + (f" ({without} on this page without a caption)" if without else ""))
        self.prev.set_enabled(page.offset > 0)
        self.next.set_enabled(last < page.total)
        with self.grid:
            for i, item in enumerate(page.items):
                self._card(page.offset + i, item)

    def _card(self, n: int, item: datasets.DatasetImage) -> None:
        """One image with its caption editor (saved on blur or with the button)."""
        with ui.card().classes("p-2 gap-1").props(f'data-testid="image-{n}"'):
            ui.image(image_url(item.image)).classes("w-full").props("fit=contain")
            size = f" · {item.width}x{item.height}" if item.width else ""
            if item.frames is not None and item.fps:  # a video, shown as its first frame
                size += f" · {item.frames / item.fps:.1f} s, {item.frames} frames at " \
                        f"{item.fps:g} fps"
            with ui.row().classes("items-center gap-1"):
                ui.checkbox(value=item.image in self.tools.selected,
                            on_change=lambda e, p=item.image: self._tick(p, e.value)) \
                    .props(f'dense data-testid="select-{n}"')
                ui.label(f"{Path(item.image).name}{size}").classes("text-xs text-gray-600")
            area = ui.textarea(value=item.caption or "",
                               placeholder="no caption file (the default caption is used)") \
                .classes("w-full").props(f'dense outlined autogrow data-testid="caption-{n}"')
            with ui.row().classes("items-center gap-2"):
                status = ui.label(item.error or "").classes("text-xs") \
                    .props(f'data-testid="caption-status-{n}"')
                saved = {"text": item.caption}

                async def save() -> None:
                    if area.value == saved["text"]:
                        return
                    try:
                        path = await run.io_bound(datasets.edit_caption, self.ctx.roots,
                                                  item.image, area.value or "")
                    except (PathOutsideRoots, ValueError, OSError) as err:
                        status.set_text(str(err))
                        status.classes(replace="text-xs text-red-700")
                        return
                    saved["text"] = area.value
                    status.set_text(f"saved to {path.name}")
                    status.classes(replace="text-xs text-green-700")

                area.on("blur", save)
                ui.button(icon="save", on_click=save).props(f'flat dense data-testid="save-{n}"')

    def _tick(self, image: str, ticked: bool) -> None:
        """Add or drop `image` from the images a bulk edit over the ticked ones covers."""
        (self.tools.selected.add if ticked else self.tools.selected.discard)(image)

    async def show_report(self) -> None:
        """Compute and show the report (probing every image: off the event loop)."""
        source = self._source()
        self.report.clear()
        if source is None:
            return
        with self.report:
            spinner = ui.spinner()
        try:
            found = await run.io_bound(datasets.report, source,
                                       int(self.resolution.value or 1024), None, self.ctx.roots)
        except (ValueError, DifftuneError) as err:
            self.report.clear()
            self._error(str(err))
            return
        finally:
            spinner.delete()
        with self.report:
            render_report(found, self.ctx)


def render_report(found: datasets.DatasetReport, ctx: UiContext) -> None:
    """The report's tables and charts."""
    if found.error:
        error_box(found.error)
        return
    s = found.summary
    styles = found.caption_styles
    ui.label(f"{s.get('images', 0)} images, {s.get('skipped', 0)} skipped, "
             f"{s.get('captions_missing', 0)} without caption, {s.get('upscaled', 0)} upscaled; "
             f"captions: {styles.get('tags', 0)} tag lists, {styles.get('prose', 0)} prose "
             "(tags are counted in tag lists only)").props('data-testid="report-summary"')
    with ui.row().classes("w-full gap-4 items-start"):
        ui.table(title="Buckets", columns=_columns(("resolution", "Resolution"),
                                                   ("bucket", "Bucket"), ("images", "Images")),
                 rows=[{"id": i, **b} for i, b in enumerate(found.buckets)]) \
            .props('dense data-testid="buckets"')
        ui.table(title="Caption length", columns=_columns(("words", "Words"),
                                                          ("images", "Images")),
                 rows=[{"id": i, **b} for i, b in enumerate(found.lengths)],
                 pagination=10).props('dense data-testid="caption-lengths"')
    ui.table(title="Skipped by check", columns=_columns(("path", "Image"), ("reason", "Reason")),
             rows=[{"id": i, "path": ctx.roots.relative(Path(s["path"])), "reason": s["reason"]}
                   for i, s in enumerate(found.skipped)]) \
        .classes("w-full").props('dense wrap-cells data-testid="skipped"')
    if found.missing_captions:
        ui.label("Without a caption file: " + ", ".join(
            Path(p).name for p in found.missing_captions)).props('data-testid="missing-captions"')
    tags = found.tags[:TOP_TAGS][::-1]  # the chart draws its first category at the bottom
    ui.echart({
        "title": {"text": f"Tags by frequency (top {len(tags)} of {len(found.tags)})",
                  "textStyle": {"fontSize": 14}},
        "tooltip": {}, "grid": {"left": 200, "right": 20, "top": 40, "bottom": 20},
        "xAxis": {"type": "value", "minInterval": 1},
        "yAxis": {"type": "category", "data": [t["tag"][:40] for t in tags]},
        "series": [{"type": "bar", "data": [t["count"] for t in tags]}],
    }).classes("w-full").style(f"height: {max(160, 60 + 22 * len(tags))}px") \
        .props('data-testid="tags-chart"')


def _columns(*names: tuple[str, str]) -> list[dict[str, Any]]:
    """Table columns from (field, label) pairs."""
    return [{"name": f, "label": label, "field": f, "align": "left", "sortable": True}
            for f, label in names]
