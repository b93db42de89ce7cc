"""The run page's checkpoints and files: each with its kind, step and size, its metadata on
request, a download, "sample with this LoRA" for a LoRA file, and "resume from here" for a
complete checkpoint, which first says what resuming from it replaces and asks.

A long run holds hundreds of checkpoints: the newest rows are shown (all on request), and a
row is drawn again only when its file changed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable
from urllib.parse import urlencode

from nicegui import ui

from difftune.files.names import COMFYUI_DORA
from difftune.ui import lora_samples
from difftune.ui.pages.keyed import Keyed
from difftune.ui.pages.lora import page_url
from difftune.ui.resume_from import replaced_by_resume
from difftune.ui.run_outputs import RunFile, run_prompts
from difftune.ui.security import PathOutsideRoots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext

ROWS_SHOWN = 40  # the newest files shown at first (final files last, always among them)


class FilesPanel:
    """The list of the run's files, kept in step with what is on disk."""

    def __init__(self, ctx: "UiContext", run_dir: Path,
                 resume: Callable[[Path], Awaitable[None]]) -> None:
        self.ctx, self.run_dir, self.resume = ctx, run_dir, resume
        self.can_resume = False
        self.found: dict[str, RunFile] = {}
        self.items: list[RunFile] = []
        self.all = False
        self.more = ui.button(on_click=self._show_all).props('flat data-testid="files-more"')
        self.more.visible = False
        self.rows = Keyed(ui.column().classes("w-full gap-1").props('data-testid="files"'))
        self.sampler = LoraSampleDialog(ctx, run_dir)
        self.confirm = ResumeConfirm(ctx, run_dir, resume)

    def update(self, items: list[RunFile], can_resume: bool) -> None:
        """Show `items` (the run's files as they are now) with the actions `can_resume`
        allows; only rows that are new or changed are drawn."""
        self.items, self.can_resume = items, can_resume
        self.found = {f.path: f for f in items}
        shown = items if self.all else items[-ROWS_SHOWN:]
        self.rows.sync([(f.path, (f.size, f.complete, f.step, len(f.metadata), can_resume))
                        for f in shown], self._row)
        self.more.visible = len(shown) < len(items)
        self.more.text = f"show all {len(items)} files ({len(items) - len(shown)} older)"

    def _show_all(self) -> None:
        self.all = True
        self.update(self.items, self.can_resume)

    def _row(self, key: str) -> ui.element:
        """A checkpoint or model file: kind, step, size, actions; metadata in an expansion
        filled when opened."""
        item = self.found[key]
        path = Path(item.path)
        with ui.column().classes("w-full gap-0") as box:
            with ui.row().classes("w-full items-center gap-3"):
                ui.label(item.kind).classes("w-24")
                ui.label(path.name + ("" if item.complete else " (incomplete)")) \
                    .classes("font-mono grow")
                ui.label(f"step {item.step}" if item.step is not None else "")
                ui.label(f"{item.size / 2**20:.1f} MiB" if item.size else "")
                self._actions(item, path)
            if item.metadata:
                more = ui.expansion("metadata").classes("w-full text-sm") \
                    .props(f'data-testid="metadata-{path.name}"')
                more.on_value_change(_filler(more, item))
        return box

    def _actions(self, item: RunFile, path: Path) -> None:
        """Download and sample (a weight file), resume from here (a complete checkpoint)."""
        if item.kind != "checkpoint":
            ui.link("download", f"/api/runs/file?{urlencode({'path': item.path})}") \
                .props(f'download data-testid="download-{path.name}"')
        if item.kind == "lora":
            ui.link("inspect, verify, convert, resize", page_url(item.path)) \
                .props(f'data-testid="lora-page-{path.name}"')
        if item.kind == "lora" and not path.stem.endswith(COMFYUI_DORA):  # (ComfyUI's alone)
            ui.button("sample with this LoRA", on_click=lambda: self.sampler.open(path)) \
                .props(f'flat dense data-testid="sample-lora-{path.name}"')
        elif item.kind == "checkpoint" and item.complete and self.can_resume:
            ui.button("resume from here", on_click=lambda: self.confirm.ask(path, item.step)) \
                .props(f'flat dense data-testid="resume-from-{path.name}"')


def _filler(box: ui.expansion, item: RunFile) -> Callable[[Any], None]:
    """What draws a file's metadata into its expansion the first time it opens (hundreds of
    rows must not each hold a JSON view until asked)."""
    filled: list[bool] = []

    def fill(event: Any) -> None:
        if event.value and not filled:
            filled.append(True)
            with box:
                ui.code(json.dumps(item.metadata, indent=1), language="json").classes("w-full")

    return fill


class ResumeConfirm:
    """Before resuming from a checkpoint: what the run wrote after it, which the resumed run
    replaces, and a choice to go on or not."""

    def __init__(self, ctx: "UiContext", run_dir: Path,
                 resume: Callable[[Path], Awaitable[None]]) -> None:
        self.ctx, self.run_dir, self.resume = ctx, run_dir, resume
        self.checkpoint: Path | None = None
        with ui.dialog() as self.dialog, ui.card().props('data-testid="resume-confirm"'):
            self.title = ui.label().classes("text-lg font-bold")
            self.text = ui.column().classes("gap-1").props('data-testid="resume-confirm-text"')
            with ui.row():
                ui.button("Cancel", on_click=self.dialog.close).props(
                    'flat data-testid="resume-confirm-cancel"')
                self.ok = ui.button(on_click=self._go, color="negative") \
                    .props('data-testid="resume-confirm-ok"')

    async def ask(self, checkpoint: Path, step: int | None) -> None:
        """Open the confirmation for resuming from `checkpoint` (at `step`)."""
        self.checkpoint = checkpoint
        later = await asyncio.to_thread(replaced_by_resume, self.run_dir, step or 0,
                                        self.ctx.roots)
        self.title.text = f"Resume from {checkpoint.name} (step {later.step})?"
        self.text.clear()
        with self.text:
            if later.nothing:
                ui.label("The run wrote nothing after this step: nothing is replaced.")
            else:
                ui.label(f"The run goes on from step {later.step} in the same folder. What it "
                         "wrote after that step is replaced as it trains again:")
                for line in later.lines():
                    ui.label(f"• {line}").classes("text-sm")
        self.ok.text = "Resume and replace them" if not later.nothing else "Resume"
        self.dialog.open()

    async def _go(self) -> None:
        self.dialog.close()
        if self.checkpoint is not None:
            await self.resume(self.checkpoint)


class LoraSampleDialog:
    """"Sample with this LoRA": prompts, seeds and strength, queued as a `difftune sample`
    job whose images go to a folder of their own (see lora_samples)."""

    def __init__(self, ctx: "UiContext", run_dir: Path) -> None:
        self.ctx, self.run_dir = ctx, run_dir
        self.lora: Path | None = None
        with ui.dialog() as self.dialog, ui.card().classes("w-[40rem]") \
                .props('data-testid="lora-sample-dialog"'):
            self.title = ui.label().classes("text-lg font-bold")
            self.prompts = ui.textarea("prompts (one a line)").classes("w-full") \
                .props('data-testid="lora-prompts"')
            with ui.row().classes("w-full"):
                self.seeds = ui.input("seeds (e.g. 0, 1, 2)").props('data-testid="lora-seeds"')
                self.strength = ui.number("strength", value=1.0, step=0.1) \
                    .props('data-testid="lora-strength"')
            self.error = ui.label().classes("text-negative text-sm") \
                .props('data-testid="lora-sample-error"')
            with ui.row():
                ui.button("Cancel", on_click=self.dialog.close).props("flat")
                ui.button("Sample", on_click=self._submit).props('data-testid="lora-sample-ok"')

    async def open(self, lora: Path) -> None:
        """Open the dialog for `lora`, its prompts and seed those of the run's samples."""
        self.lora = lora
        self.title.text = f"Sample with {lora.name}"
        self.error.text = ""
        prompts = await asyncio.to_thread(run_prompts, self.run_dir, self.ctx.roots)
        if not self.prompts.value:
            self.prompts.value = "\n".join(p.text for p in prompts)
        if not self.seeds.value:
            self.seeds.value = str(prompts[0].seed if prompts and prompts[0].seed else 0)
        self.dialog.open()

    async def _submit(self) -> None:
        if self.lora is None:
            return
        try:
            request = lora_samples.Request.checked(
                str(self.prompts.value or "").splitlines(),
                lora_samples.parse_seeds(str(self.seeds.value or "")),
                float(self.strength.value if self.strength.value is not None else "nan"))
            job, folder = await asyncio.to_thread(lora_samples.submit, self.ctx,
                                                  str(self.lora), request)
        except (ValueError, PathOutsideRoots) as err:
            self.error.text = str(err)
            return
        self.dialog.close()
        ui.notify(f"sample job {job.id} queued: its images go to "
                  f"{self.ctx.roots.relative(folder)} (it runs when the device is free)")
