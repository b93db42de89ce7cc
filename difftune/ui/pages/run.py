"""The run page ("/run?job=ID" or "/run?path=RUN_DIR"): watch one run as its files say it is.

Status, step/total, it/s, ETA and GPU memory come from metrics.jsonl; the log from the job's
log file; the chart, gallery and file list from the run folder. "Sample now" and "Save now"
write request files the training loop honours after its current step (`difftune request`
does the same from a shell).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from nicegui import run, ui

from difftune.train.requests import make_request
from difftune.ui import run_outputs as outputs
from difftune.ui import runs
from difftune.ui.pages.charts import loss_chart_options
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.pages.states import state_color
from difftune.ui.security import PathOutsideRoots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext
    from difftune.ui.jobs.store import Job

# States a train job can be resumed from (a finished run has nothing left to train).
RESUMABLE = {"stopped", "failed", "died"}


def register(ctx: "UiContext") -> None:
    """Define the "/run" page."""

    @ui.page("/run")
    def run_page(job: int | None = None, path: str | None = None) -> None:
        with frame("Run"):
            try:
                view = RunView(ctx, job, path)
            except (KeyError, PathOutsideRoots, ValueError) as err:
                error_box(str(err) if not isinstance(err, KeyError) else f"no job {job}")
                return
            view.build()
            ui.timer(1.0, view.refresh)


class RunView:
    """One open run page: what it shows and how it follows the run's files."""

    def __init__(self, ctx: "UiContext", job_id: int | None, path: str | None) -> None:
        self.ctx = ctx
        self.job: "Job | None" = ctx.queue.get(job_id) if job_id is not None else None
        if self.job is not None:
            self.run_dir = Path(self.job.run_dir)
        elif path:
            self.run_dir = ctx.roots.resolve(path)
        else:
            raise ValueError("open a run from the jobs page (/run?job=ID) or by its folder "
                             "(/run?path=RUN_DIR)")
        self.rows: list[dict[str, Any]] = []
        self.busy = False
        self.log_offset = 0
        self.shown_samples = -1
        self.shown_files: list[str] = []

    def build(self) -> None:
        """Lay out the page's parts (filled by `refresh`)."""
        ui.label(str(self.run_dir)).classes("font-mono text-sm text-gray-600")
        with ui.row().classes("w-full items-center gap-4"):
            self.state = ui.badge("…").props('data-testid="run-state"')
            self.progress = ui.label().props('data-testid="run-progress"')
            self.speed = ui.label().props('data-testid="run-speed"')
            self.actions = ui.row().classes("gap-2")
        self.error = ui.column().classes("w-full")
        self.chart = ui.echart(loss_chart_options([])).classes("w-full h-80") \
            .props('data-testid="loss-chart"')
        with ui.expansion("Log", value=True).classes("w-full"):
            self.log = ui.log(max_lines=2000).classes("w-full h-64").props('data-testid="log"')
        ui.label("Samples").classes("text-xl")
        self.gallery = ui.column().classes("w-full gap-2").props('data-testid="gallery"')
        ui.label("Checkpoints and files").classes("text-xl")
        self.files = ui.column().classes("w-full gap-1").props('data-testid="files"')
        ui.timer(0, self.refresh, once=True)

    async def refresh(self) -> None:
        """Read what changed on disk and update the parts that show it (one refresh at a
        time: a slow read must not let the next tick append the same rows twice)."""
        if self.busy:
            return
        self.busy = True
        try:
            await self._refresh()
        finally:
            self.busy = False

    async def _refresh(self) -> None:
        if self.job is not None:
            self.job = await run.io_bound(self.ctx.queue.get, self.job.id)
        summary = await run.io_bound(runs.summary, self.run_dir, self.ctx.roots)
        last = self._last_step()
        new = [r for r in await run.io_bound(runs.metrics, self.run_dir, last, self.ctx.roots)
               if r.get("step", 0) > last]
        self._status(summary)
        if new:
            self.rows.extend(new)
            self.chart.options.clear()
            self.chart.options.update(loss_chart_options(self.rows))
            self.chart.update()
        await self._follow_log()
        await self._gallery()
        await self._files()

    def _last_step(self) -> int:
        return int(self.rows[-1]["step"]) if self.rows else 0

    def _status(self, summary: "runs.RunSummary") -> None:
        """State badge, step/total, it/s, ETA, GPU memory, the error and the actions."""
        state = self.job.state if self.job else ("finished" if summary.finished else "—")
        self.state.text = state
        self.state.set_background_color(state_color(state))
        total = summary.total_steps or "?"
        self.progress.text = f"step {summary.step}/{total}"
        bits = []
        if summary.it_per_s:
            bits.append(f"{summary.it_per_s:.2f} it/s")
        if summary.eta_s and state in ("running", "—"):
            bits.append(f"ETA {_duration(summary.eta_s)}")
        if summary.gpu_mem:
            bits.append(f"GPU {summary.gpu_mem:.1f} GiB")
        self.speed.text = " · ".join(bits)
        self.error.clear()
        if self.job is not None and self.job.error:
            with self.error:
                error_box(self.job.error)
        self._actions(state)

    def _actions(self, state: str) -> None:
        """Buttons for the current state (rebuilt only when the state changes)."""
        if getattr(self, "_actions_for", None) == state:
            return
        self._actions_for = state
        self.actions.clear()
        with self.actions:
            if state == "running":
                ui.button("Sample now", on_click=lambda: self._request("sample")) \
                    .props('data-testid="sample-now"')
                ui.button("Save now", on_click=lambda: self._request("save")) \
                    .props('data-testid="save-now"')
                ui.button("Stop", color="negative", on_click=self._stop).props('data-testid="stop"')
            if state == "stopping":  # a run that hangs on SIGTERM: kill it
                ui.button("Kill", color="negative", on_click=self._stop).props('data-testid="kill"')
            if self.job is not None and state in RESUMABLE and self.job.verb == "train" \
                    and self.job.checkpoints:
                ui.button("Resume", on_click=self._resume).props('data-testid="resume"')

    async def _request(self, kind: str) -> None:
        path = await run.io_bound(make_request, self.run_dir, kind)
        ui.notify(f"{kind} requested ({path.name}): the run does it after its current step")

    async def _stop(self) -> None:
        assert self.job is not None
        killing = self.job.state == "stopping"
        self.job = await run.io_bound(self.ctx.queue.stop, self.job.id)
        ui.notify("killed: resume from its last checkpoint" if killing else
                  "stop sent: the run saves a checkpoint and exits")

    async def _resume(self, checkpoint: Path | None = None) -> None:
        assert self.job is not None
        try:
            if checkpoint is None:
                new = await run.io_bound(self.ctx.queue.resume, self.job.id)
            else:
                new = await run.io_bound(self.ctx.queue.submit, "train", Path(self.job.config),
                                         ["--resume", str(checkpoint)])
        except (ValueError, KeyError) as err:
            ui.notify(str(err), type="negative", multi_line=True)
            return
        ui.navigate.to(f"/run?job={new.id}")

    async def _follow_log(self) -> None:
        """Append the log's new lines (the job's own log file, or the run's difftune.log when
        the run was opened by its folder), read from where we stopped; not one that is a
        link leading outside the roots."""
        log = Path(self.job.log) if self.job is not None else self.run_dir / "difftune.log"
        real = runs.readable(log, self.run_dir, self.ctx.roots)
        if real is None:
            return
        text, self.log_offset = await run.io_bound(_read_from, real, self.log_offset)
        for line in text.splitlines():
            self.log.push(line)

    async def _gallery(self) -> None:
        """Samples by step (newest first), each with its prompt; redrawn when new ones land."""
        images = await run.io_bound(outputs.samples, self.run_dir, self.ctx.roots)
        if len(images) == self.shown_samples:
            return
        self.shown_samples = len(images)
        self.gallery.clear()
        by_step: dict[int, list[outputs.SampleImage]] = {}
        for image in images:
            by_step.setdefault(image.step if image.step is not None else -1, []).append(image)
        with self.gallery:
            for step in sorted(by_step, reverse=True):
                ui.label(f"step {step}" if step >= 0 else "other").classes("font-bold")
                with ui.row().classes("gap-2").props(f'data-testid="samples-step-{step}"'):
                    for image in sorted(by_step[step], key=lambda i: i.index):
                        _thumb(image)

    async def _files(self) -> None:
        """Checkpoints and model files with their metadata, download and resume-from."""
        found = await run.io_bound(outputs.files, self.run_dir, self.ctx.roots)
        names = [f"{f.path}:{f.size}" for f in found]
        if names == self.shown_files:
            return
        self.shown_files = names
        self.files.clear()
        with self.files:
            for item in found:
                _file_row(self, item)


def _thumb(image: "outputs.SampleImage") -> None:
    """One sample with its prompt under it."""
    with ui.column().classes("w-40 gap-0"):
        ui.image(f"/api/runs/image?{urlencode({'path': image.path})}").classes("w-40 h-40") \
            .props('fit="contain" data-testid="sample"')
        ui.label(image.prompt).classes("text-xs")


def _file_row(view: RunView, item: "outputs.RunFile") -> None:
    """A checkpoint or model file: kind, step, size; metadata in an expansion."""
    path = Path(item.path)
    with ui.row().classes("w-full items-center gap-3"):
        ui.label(item.kind).classes("w-24")
        ui.label(path.name + ("" if item.complete else " (incomplete)")).classes("font-mono grow")
        ui.label(f"step {item.step}" if item.step is not None else "")
        ui.label(f"{item.size / 2**20:.1f} MiB" if item.size else "")
        if item.kind != "checkpoint":
            ui.link("download", f"/api/runs/file?{urlencode({'path': item.path})}") \
                .props(f'download data-testid="download-{path.name}"')
        elif item.complete and view.job is not None and view.job.verb == "train":
            ui.button("resume from here", on_click=lambda p=path: view._resume(p)) \
                .props(f'flat dense data-testid="resume-from-{path.name}"')
    if item.metadata:
        with ui.expansion("metadata").classes("w-full text-sm"):
            ui.json_editor({"content": {"json": item.metadata}}).props("read-only")


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    """The text of `path` from byte `offset` (up to 256 KiB), and the next offset."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(256 * 1024)
    except FileNotFoundError:
        return "", offset
    end = data.rfind(b"\n") + 1  # whole lines only; the rest comes next time
    return data[:end].decode("utf-8", "replace"), offset + end


def _duration(seconds: float) -> str:
    """12 s, 3 min 20 s, 1 h 05 min."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
