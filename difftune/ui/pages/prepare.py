"""/prepare: make a run file from a preset, a form per section and a TOML view kept in sync.

The form is generated from the config models (`forms.schema`); fields that do not apply to the
chosen family, adapter and options are hidden (`forms.applies`); every change is validated with
the CLI's own parser and the CLI's message is shown; the TOML view is the file itself, edited
with tomlkit so a value changed in the form changes only that value. "Check" and "Start
training" save the file and submit `difftune check` / `difftune train` jobs to the queue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nicegui import events, run, ui

from difftune.errors import ConfigError
from difftune.ui.api.config import FileExists, Service
from difftune.ui import limits
from difftune.ui.context import UiContext
from difftune.ui.forms import presets, schema, toml_io
from difftune.ui.jobs.store import Job
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.pages.model_picker import ModelPicker
from difftune.ui.pages.run_form import Form
from difftune.ui.security import PathOutsideRoots

FINISHED = ("succeeded", "failed", "stopped", "cancelled", "died")


class Prepare:
    """The state of one /prepare page: the TOML text and the inputs bound to it."""

    def __init__(self, ctx: UiContext) -> None:
        self.ctx, self.service = ctx, Service(ctx)
        self.text = ""
        self.form = Form(self.changed, self.add_item, self.remove_item)
        self.syncing = False
        self.owned: Path | None = None  # a file this page loaded or saved (may be replaced)
        self.timer: ui.timer | None = None
        self.valid = False  # whether the text validated (Start is offered only then)

    # --- building -------------------------------------------------------------------------
    def build(self) -> None:
        """Lay out the page: presets and paths, the form, the TOML view, the actions."""
        made, _ = presets.build()
        with ui.row().classes("w-full items-end gap-4"):
            ui.select({p.name: p.title for p in made}, label="Preset (family · GPU memory)",
                      on_change=lambda e: self.pick(e.value)) \
                .classes("min-w-[22rem]").props('data-testid="preset"')
            self.path = ui.input("Save to (under the roots)").classes("grow") \
                .props('data-testid="save-path"')
            ModelPicker(self.ctx, self.use_model)
        self.memory = ui.label("").classes("text-sm text-gray-600") \
            .props('data-testid="preset-memory"')
        self.errors = ui.column().classes("w-full")
        self.warnings = ui.column().classes("w-full")
        with ui.row().classes("w-full no-wrap items-start gap-4"):
            with ui.column().classes("w-1/2 gap-1"):
                self.form.build()
            with ui.column().classes("w-1/2 gap-2 sticky top-16 self-start"):
                self.editor = ui.codemirror("", language="TOML", on_change=self.edited) \
                    .classes("w-full h-[36rem] border").props('data-testid="toml"')
                self._files()
        self._actions()

    def _files(self) -> None:
        with ui.row().classes("w-full items-center gap-2"):
            ui.upload(label="Import a .toml", auto_upload=True, on_upload=self.uploaded) \
                .props('accept=".toml" data-testid="import"').classes("w-64")
            self.load_path = ui.input("Import from a path").classes("grow") \
                .props('data-testid="load-path"')
            ui.button("Load", on_click=self.load).props('data-testid="load" flat')
        with ui.row().classes("gap-2"):
            ui.button("Download", on_click=lambda: ui.download.content(
                self.text, "run.toml")).props('data-testid="download" flat')
            ui.button("Save", on_click=self.save_clicked).props('data-testid="save"')
        self.saved = ui.label("").props('data-testid="saved"').classes("text-sm")

    def _actions(self) -> None:
        with ui.row().classes("gap-2 items-center"):
            ui.button("Check", on_click=self.check).props('data-testid="check"')
            self.start_button = ui.button("Start training", on_click=self.start).props(
                'data-testid="start" color="positive"')
            self.start_why = ui.label("").classes("text-sm text-red-800") \
                .props('data-testid="start-why"')
            self.job_state = ui.label("").props('data-testid="check-state"')
        self.startable(False, "pick a preset or load a run file to start training")
        self.report = ui.label("").classes("w-full whitespace-pre-wrap font-mono text-xs") \
            .props('data-testid="check-report"')

    # --- keeping the form, the TOML and the messages in step -----------------------------
    def set_text(self, text: str, from_editor: bool = False) -> None:
        """Make `text` the run file: the inputs, visibility and messages follow."""
        self.text = text
        if not from_editor:
            self.syncing = True
            self.editor.value = text
            self.syncing = False
        try:
            form = self.service.form(text)
            doc = toml_io.parse(text)
        except ConfigError as err:
            self.show_error(str(err))
            self.startable(False)
            return
        self.syncing = True
        try:
            self.form.sync(doc)
            self.form.show(form.values, form.hidden)
        finally:
            self.syncing = False
        self.apply_choices(form.choices)
        ui.timer(0.01, self.validate, once=True)

    def apply_choices(self, choices: dict[str, list[Any]]) -> None:
        """Refresh family-dependent choices."""
        variant = self.form.inputs.get("model.variant")
        if variant is not None and "model.variant" in choices:
            variant.widget.props(f'hint="one of: {", ".join(choices["model.variant"])}"')

    def changed(self, path: str, value: Any) -> None:
        """A form input changed: write that one value into the TOML."""
        if not self.syncing:
            self._edit(lambda doc: toml_io.set_value(doc, path, value))

    def _edit(self, change: Any) -> None:
        """Apply `change` (a function of the parsed document) to the TOML; the form follows."""
        try:
            doc = toml_io.parse(self.text)
        except ConfigError as err:
            self.show_error(str(err))
            return
        change(doc)
        self.set_text(toml_io.dumps(doc))

    def add_item(self, path: str) -> None:
        """Add an item to the list of tables at `path`, with one item of each list inside it
        (a dataset comes with a subset, whose folder the form then asks for)."""
        def add(doc: Any) -> None:
            toml_io.add_item(doc, path)
            item = f"{path}[{toml_io.count(doc, path) - 1}]"
            for inner in schema.inner_lists(schema.template(path)):
                toml_io.add_item(doc, item + inner.removeprefix(schema.template(path) + "[0]"))
        self._edit(add)

    def remove_item(self, path: str, index: int) -> None:
        """Remove item `index` of the list of tables at `path`."""
        self._edit(lambda doc: toml_io.remove_item(doc, path, index))

    def use_model(self, fields: dict[str, Any]) -> None:
        """Write a picked model's lines (family, variant, its folder or single file)."""
        def write(doc: Any) -> None:
            for path, value in fields.items():
                toml_io.set_value(doc, path, value)
        self._edit(write)

    def edited(self, e: events.ValueChangeEventArguments) -> None:
        """The TOML view changed: the form follows."""
        if not self.syncing and e.value != self.text:
            self.set_text(e.value, from_editor=True)

    async def validate(self) -> None:
        """Validate as `difftune check` would the file at the save path; show its message."""
        text = self.text
        try:
            result = await run.io_bound(self.service.validate, text, self.path.value or None)
        except PathOutsideRoots as err:
            self.show_error(str(err))
            self.startable(False)
            return
        if text != self.text:
            return  # a newer edit validates itself
        self.show_error(self.form.show_problems(result.message))
        self.startable(result.ok)
        self.warnings.clear()
        with self.warnings:
            for line in result.warnings:
                ui.label(f"warning: {line}").classes("text-amber-700 text-sm")

    def startable(self, ok: bool, why: str = "fix the errors shown to start training") -> None:
        """Offer "Start training" only for a run file that validates; say why not."""
        self.valid = ok
        self.start_button.set_enabled(ok)
        self.start_why.text = "" if ok else why

    def show_error(self, message: str | None) -> None:
        """Show the CLI's message (or clear it)."""
        self.errors.clear()
        if message:
            with self.errors:
                error_box(f"error: {message}")

    # --- presets, import, export ------------------------------------------------------------
    def pick(self, name: str | None) -> None:
        """Load preset `name` into the form, and propose its default save path."""
        if not name:
            return
        preset = presets.get(name)
        text = preset.toml
        self.memory.text = preset.note()
        self.path.value = str(self.service.default_path(text))
        self.owned = None
        self.set_text(text)

    async def uploaded(self, e: events.UploadEventArguments) -> None:
        """An imported .toml into the editor: over 1 MiB or not UTF-8, its error shown instead
        (the editor keeps what it had)."""
        name = e.file.name or "the imported file"
        try:
            if e.file.size() > limits.MAX_TEXT_BYTES:
                raise limits.TooLarge(f"{name} is over 1 MiB, too large for a run file")
            text = limits.decode(await e.file.read(), name)
        except ConfigError as err:
            self.show_error(str(err))
            return
        self.set_text(text)

    def load(self) -> None:
        try:
            form = self.service.load(self.load_path.value)
        except (PathOutsideRoots, ConfigError, OSError) as err:
            self.show_error(str(err))
            return
        self.path.value = str(self.ctx.roots.resolve(self.load_path.value))
        self.owned = Path(self.path.value)
        self.set_text(form.toml)

    def save(self) -> Path | None:
        """Save the TOML at the save path (replacing only a file this page owns)."""
        target = self.path.value or str(self.service.default_path(self.text))
        try:
            resolved = self.ctx.roots.resolve(target)
            out = self.service.save(self.text, target, overwrite=resolved == self.owned)
        except (PathOutsideRoots, FileExists, ConfigError, OSError) as err:
            self.show_error(str(err))
            return None
        self.owned = Path(out.path)
        self.path.value = out.path
        self.saved.text = f"saved {out.shown}"
        return self.owned

    def save_clicked(self) -> None:
        self.save()

    # --- jobs -------------------------------------------------------------------------------
    def check(self) -> None:
        """Save, submit `difftune check`, and show its output as it comes."""
        path = self.save()
        if path is None:
            return
        job = self.ctx.queue.submit("check", path)
        self.report.text = ""
        self.job_state.text = f"check job {job.id}: {job.state}"
        if self.timer is not None:
            self.timer.cancel()
        self.timer = ui.timer(1.0, lambda: self.poll(job.id))

    def poll(self, job_id: int) -> None:
        """Refresh the check job's state and output; stop when it has finished."""
        job = self.ctx.queue.get(job_id)
        self.report.text = "\n".join(self.ctx.queue.tail(job_id))
        self.job_state.text = f"check job {job.id}: {job.state}"
        if job.state in FINISHED and self.timer is not None:
            self.timer.cancel()
            self.timer = None
            if job.state != "succeeded" and job.error:
                self.show_error(job.error.removeprefix("error: "))

    async def start(self) -> None:
        """Validate, save, submit `difftune train`, and go to the run's page. Refused with
        the message shown while the file does not validate, and when the queue refuses (the
        run folder holds a run's results, or another training uses it: a second Start)."""
        self.start_button.disable()  # one submission per press: a double click is not two
        try:
            job = await self._train()
        except (ValueError, OSError) as err:  # (JobStateError, PathOutsideRoots)
            self.show_error(str(err))
            job = None
        if job is None:
            self.startable(self.valid)
            return
        ui.navigate.to(f"/run?job={job.id}")

    async def _train(self) -> Job | None:
        """The train job of the file as the form holds it, or None (the reason shown)."""
        result = await run.io_bound(self.service.validate, self.text, self.path.value or None)
        if result is None:
            return None  # the page was closed
        if not result.ok:
            self.show_error(self.form.show_problems(result.message))
            self.valid = False
            return None
        path = self.save()
        if path is None:
            return None
        return await run.io_bound(self.ctx.queue.submit, "train", path)


def register(ctx: UiContext) -> None:
    """The /prepare page."""

    @ui.page("/prepare")
    def prepare_page(preset: str | None = None, path: str | None = None) -> None:
        with frame("New run"):
            page = Prepare(ctx)
            page.build()
            if path:
                page.load_path.value = path
                page.load()
            elif preset:
                page.pick(preset)
