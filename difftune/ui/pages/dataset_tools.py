"""The dataset page's tools for a folder: upload images and caption files into it, and edit
its captions in bulk (add or remove a trigger word, find and replace; over every image or the
ones ticked in the grid) with an undo of the last bulk edit.

They call what the /api/datasets routes call (`dataset_uploads`, `caption_bulk`), so the same
rules hold: names checked, no file replaced, every path under the roots, the undo journal kept
in the dataset folder.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nicegui import run, ui

from difftune.ui import caption_bulk, dataset_uploads
from difftune.ui.context import UiContext
from difftune.ui.limits import MAX_TEXT_BYTES, MAX_UPLOAD_BYTES
from difftune.ui.security import PathOutsideRoots

OPS = {"add": "Add trigger word", "remove": "Remove trigger word", "replace": "Find and replace"}
REFUSED = (PathOutsideRoots, ValueError, OSError)


def _note(label: ui.label, text: str, ok: bool) -> None:
    """Show `text` on `label`, green when `ok`, red otherwise."""
    label.set_text(text)
    label.classes(replace="text-sm " + ("text-green-700" if ok else "text-red-700"))


class DatasetTools:
    """Upload and bulk-edit controls over the folder `folder()` names (None: no folder open);
    `reload()` redraws the grid after a change; `selected` holds the ticked images."""

    def __init__(self, ctx: UiContext, folder: Callable[[], Path | None],
                 reload: Callable[[], Awaitable[None]]) -> None:
        self.ctx, self.folder, self.reload = ctx, folder, reload
        self.selected: set[str] = set()
        with ui.expansion("Add images and edit captions in bulk", icon="edit_note") \
                .classes("w-full").props('data-testid="dataset-tools"'):
            self._upload_row()
            self._bulk_row()

    def _upload_row(self) -> None:
        images, captions = dataset_uploads.kinds()
        ui.label(f"Upload images ({', '.join(images)}; at most {MAX_UPLOAD_BYTES >> 20} MiB "
                 f"each) and caption files ({', '.join(captions)}; UTF-8, at most "
                 f"{MAX_TEXT_BYTES >> 20} MiB) into the open folder. A file whose name is taken "
                 "is refused, never replaced.").classes("text-sm")
        ui.upload(multiple=True, auto_upload=True, max_file_size=MAX_UPLOAD_BYTES,
                  on_upload=self._uploaded, label="Upload into this folder",
                  on_rejected=lambda: _note(self.upload_note, "refused by the browser: larger "
                                            f"than {MAX_UPLOAD_BYTES >> 20} MiB", False)) \
            .props(f'accept="{",".join(dataset_uploads.allowed_extensions())}" '
                   'data-testid="dataset-upload"').classes("w-96")
        self.upload_note = ui.label("").props('data-testid="upload-status"')

    def _bulk_row(self) -> None:
        with ui.row().classes("w-full items-end gap-3"):
            self.op = ui.select(OPS, value="add", label="Bulk edit", on_change=self._shown) \
                .classes("w-52").props('data-testid="bulk-op"')
            self.text = ui.input("Trigger word").classes("w-48").props('data-testid="bulk-text"')
            self.where = ui.select({"start": "at the start", "end": "at the end"},
                                   value="start", label="Where").classes("w-36") \
                .props('data-testid="bulk-where"')
            self.replacement = ui.input("Replace with").classes("w-48") \
                .props('data-testid="bulk-replacement"')
            self.scope = ui.radio({"all": "all images", "selected": "ticked images"},
                                  value="all").props('inline data-testid="bulk-scope"')
            ui.button("Apply", on_click=self.apply).props('data-testid="bulk-apply"')
            self.undo_button = ui.button("Undo last bulk edit", on_click=self.undo) \
                .props('flat data-testid="bulk-undo"')
            self.undo_info = ui.label("").classes("text-xs text-gray-600") \
                .props('data-testid="undo-info"')
        self.bulk_note = ui.label("").props('data-testid="bulk-status"')
        self._shown()

    def _shown(self) -> None:
        """Show the fields the chosen operation uses."""
        replace = self.op.value == "replace"
        self.text.props(f'label="{"Find" if replace else "Trigger word"}"')
        self.where.set_visibility(not replace)
        self.replacement.set_visibility(replace)

    async def refresh_undo(self) -> None:
        """Enable Undo when the open folder has a journaled bulk edit, naming it."""
        folder = self.folder()
        last = None
        if folder is not None and folder.is_dir():
            try:
                last = await run.io_bound(caption_bulk.last_edit, self.ctx.roots, folder)
            except REFUSED:
                last = None
        self.undo_button.set_enabled(last is not None)
        e = last["edit"] if last is not None else None
        self.undo_info.set_text("" if e is None else f"(last: {OPS[e['op']].lower()} "
                                f"{e['text']!r}, {len(last['files'])} caption files)")

    async def _uploaded(self, event: Any) -> None:
        """Write one uploaded file into the folder (or say why not), then redraw the grid."""
        folder, name = self.folder(), event.file.name
        if folder is None or not folder.is_dir():
            _note(self.upload_note, f"{name!r}: open a folder first", False)
            return
        spool = Path(tempfile.mkdtemp(prefix="difftune-upload-"))
        try:
            await event.file.save(spool / "file")
            with (spool / "file").open("rb") as stream:
                saved = await run.io_bound(dataset_uploads.save_one, self.ctx.roots, folder,
                                           dataset_uploads.Incoming(name, stream))
        except REFUSED as err:
            _note(self.upload_note, f"refused {err}", False)
            return
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        if saved is None:  # the page went away meanwhile
            return
        _note(self.upload_note, f"saved {saved.name}", True)
        await self.reload()

    async def apply(self) -> None:
        """Apply the bulk edit to the folder's captions (all, or the ticked images)."""
        folder = self.folder()
        if folder is None:
            _note(self.bulk_note, "open a folder first", False)
            return
        if not (self.text.value or "").strip():
            _note(self.bulk_note, "give the trigger word (or the text to find)", False)
            return
        if self.scope.value == "selected" and not self.selected:
            _note(self.bulk_note, "no image is ticked; tick images or choose all", False)
            return
        edit = caption_bulk.BulkEdit(self.op.value, self.text.value, self.where.value,
                                     self.replacement.value or "")
        chosen = sorted(self.selected) if self.scope.value == "selected" else None
        await self._edit("changed {} caption files", caption_bulk.bulk_edit, self.ctx.roots,
                         folder, edit, chosen)

    async def undo(self) -> None:
        """Put back the captions the last bulk edit changed."""
        folder = self.folder()
        if folder is not None:
            await self._edit("undone: {} caption files restored", caption_bulk.undo,
                             self.ctx.roots, folder)

    async def _edit(self, done: str, action: Callable[..., list[Path]], *args: Any) -> None:
        """Run `action(*args)` off the event loop, say what it did (`done` with the number of
        files) or why not, and redraw the grid."""
        try:
            changed = await run.io_bound(action, *args)
        except REFUSED as err:
            _note(self.bulk_note, str(err), False)
            return
        if changed is None:  # the page went away meanwhile
            return
        _note(self.bulk_note, done.format(len(changed)), True)
        await self.reload()
