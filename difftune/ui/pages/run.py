"""The run page ("/run?job=ID" or "/run?path=RUN_DIR"): watch one run as its files say it is.

Status, step/total, it/s, ETA and GPU memory come from metrics.jsonl; the log from the job's
log file; the chart, gallery and file list from the run folder. "Sample now" and "Save now"
write request files the training loop honours after its current step (`difftune request`
does the same from a shell).

The page reads the folder once a second in a worker thread (one hop per refresh), and only
what changed is read (see file_cache) and drawn (see keyed): a long run with thousands of
samples and hundreds of checkpoints must not keep the app's event loop busy, or the browser's
connection times out and the page reloads, losing clicks. The page also waits longer than
NiceGUI's default for a browser to reconnect (`RECONNECT_S`), so a machine loaded by a
training job does not make it reload.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nicegui import ui

from difftune.train.requests import make_request
from difftune.ui import lora_samples
from difftune.ui import run_outputs as outputs
from difftune.ui import runs
from difftune.ui.jobs import rules
from difftune.ui.pages.charts import loss_chart_options
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.pages.metric_charts import SampleMetricsPanel
from difftune.ui.pages.run_files import FilesPanel
from difftune.ui.pages.run_samples import Gallery, SampleSets, Viewer
from difftune.ui.pages.states import state_color
from difftune.ui.security import PathOutsideRoots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext
    from difftune.ui.jobs.store import Job

# States a train job can be resumed from (a finished run has nothing left to train).
RESUMABLE = {"stopped", "failed", "died"}
RECONNECT_S = 60.0  # how long the page outlives a lost connection (NiceGUI's default: 3 s)


def register(ctx: "UiContext") -> None:
    """Define the "/run" page."""

    @ui.page("/run", reconnect_timeout=RECONNECT_S)
    def run_page(job: int | None = None, path: str | None = None) -> None:
        with frame("Run"):
            try:
                view = RunView(ctx, job, path)
            except (KeyError, PathOutsideRoots, ValueError) as err:
                error_box(str(err) if not isinstance(err, KeyError) else f"no job {job}")
                return
            view.build()
            ui.timer(1.0, view.refresh)


@dataclass
class Snapshot:
    """What one refresh read from disk (in a worker thread)."""

    job: "Job | None"
    summary: runs.RunSummary
    rows: list[dict[str, Any]]
    log: str
    log_offset: int
    samples: list[outputs.SampleImage]
    files: list[outputs.RunFile]
    sets: list[lora_samples.SampleSet] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # sample-metrics rows


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
        self.shown: dict[str, object] = {}  # what each part last drew (by identity)
        self._actions_for: str | None = None

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
        self.sample_metrics = SampleMetricsPanel()
        with ui.expansion("Log", value=True).classes("w-full"):
            self.log = ui.log(max_lines=2000).classes("w-full h-64").props('data-testid="log"')
        self.viewer = Viewer()
        ui.label("Samples").classes("text-xl")
        self.gallery = Gallery(self.viewer)
        self.sets = SampleSets(self.viewer)
        ui.label("Checkpoints and files").classes("text-xl")
        self.files = FilesPanel(self.ctx, self.run_dir, self._resume)
        ui.timer(0, self.refresh, once=True)

    async def refresh(self) -> None:
        """Read what changed on disk and update the parts that show it (one refresh at a
        time: a slow read must not let the next tick append the same rows twice). A refresh
        cancelled because the page went away ends quietly."""
        if self.busy:
            return
        self.busy = True
        try:
            snap = await asyncio.to_thread(self._read, self.job.id if self.job else None,
                                           self._last_step(), self.log_offset)
            self._show(snap)
        finally:
            self.busy = False

    def _read(self, job_id: int | None, last: int, log_offset: int) -> Snapshot:
        """Everything a refresh shows, read from disk (runs in a worker thread: it must not
        touch the page's elements). Unchanged files and folders cost a `stat` each."""
        job = self.ctx.queue.get(job_id) if job_id is not None else None
        roots = self.ctx.roots
        log, offset = self._log_from(job, log_offset)
        return Snapshot(job, runs.summary(self.run_dir, roots),
                        [r for r in runs.metrics(self.run_dir, last, roots) if r["step"] > last],
                        log, offset, outputs.samples(self.run_dir, roots),
                        outputs.files(self.run_dir, roots),
                        lora_samples.sample_sets(self.run_dir, roots),
                        runs.sample_metrics(self.run_dir, roots))

    def _log_from(self, job: "Job | None", offset: int) -> tuple[str, int]:
        """The log's new whole lines from `offset` (the job's own log, or the run's
        difftune.log when the run was opened by its folder), not one that is a link leading
        outside the roots; and the offset to read from next."""
        log = Path(job.log) if job is not None else self.run_dir / "difftune.log"
        real = runs.readable(log, self.run_dir, self.ctx.roots)
        return _read_from(real, offset) if real is not None else ("", offset)

    def _show(self, snap: Snapshot) -> None:
        """Update the parts whose data changed (lists are compared by identity: the readers
        hand back the same list while nothing changed)."""
        if snap.job is not None:
            self.job = snap.job
        state = self._status(snap.summary)
        if snap.rows:
            self.rows.extend(snap.rows)
            self.chart.options.clear()
            self.chart.options.update(loss_chart_options(self.rows))
            self.chart.update()
        self.log_offset = snap.log_offset
        for line in snap.log.splitlines():
            self.log.push(line)
        if self.shown.get("samples") is not snap.samples:
            self.shown["samples"] = snap.samples
            self.gallery.update(snap.samples)
        can_resume = (self.job is not None and self.job.verb == "train"
                      and state not in ("queued", "running", "stopping"))
        if self.shown.get("files") is not snap.files or self.files.can_resume != can_resume:
            self.shown["files"] = snap.files
            self.files.update(snap.files, can_resume)
        seen = ([(e["step"], e.get("fidelity")) for e in snap.events], id(snap.files))
        if self.shown.get("events") != seen:
            self.shown["events"] = seen
            self.sample_metrics.update(snap.events, snap.files)
        sets = [(s.folder, id(s.images), s.job) for s in snap.sets]
        if self.shown.get("sets") != sets:
            self.shown["sets"] = sets
            self.sets.update(snap.sets)

    def _last_step(self) -> int:
        return int(self.rows[-1]["step"]) if self.rows else 0

    def _status(self, summary: "runs.RunSummary") -> str:
        """State badge, step/total, it/s, ETA, GPU memory, the error and the actions; returns
        the state shown."""
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
        if summary.best:
            bits.append(summary.best)
        self.speed.text = " · ".join(bits)
        error = self.job.error if self.job is not None else None
        if self.shown.get("error", "") != error:
            self.shown["error"] = error
            self.error.clear()
            if error:
                with self.error:
                    error_box(error)
        self._actions(state)
        return state

    def _actions(self, state: str) -> None:
        """Buttons for the current state (rebuilt only when the state changes)."""
        if self._actions_for == state:
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
            if self.job is not None and state in RESUMABLE and self.job.verb == "train":
                self._resume_button()

    def _resume_button(self) -> None:
        """Resume, or the same button greyed with the reason beside it (the jobs page's rule:
        a complete run or one without a checkpoint has nothing to resume)."""
        assert self.job is not None
        why = rules.resume_refusal(self.job, self.ctx.roots)
        button = ui.button("Resume", on_click=lambda: self._resume()) \
            .props('data-testid="resume"')
        if why:
            button.disable()
            ui.label(why).classes("text-sm text-grey-8").props('data-testid="why-resume"')

    async def _request(self, kind: str) -> None:
        path = await asyncio.to_thread(make_request, self.run_dir, kind)
        ui.notify(f"{kind} requested ({path.name}): the run does it after its current step")

    async def _stop(self) -> None:
        assert self.job is not None
        killing = self.job.state == "stopping"
        self.job = await asyncio.to_thread(self.ctx.queue.stop, self.job.id)
        ui.notify("killed: resume from its last checkpoint" if killing else
                  "stop sent: the run saves a checkpoint and exits")

    async def _resume(self, checkpoint: Path | None = None) -> None:
        assert self.job is not None
        try:
            if checkpoint is None:
                new = await asyncio.to_thread(self.ctx.queue.resume, self.job.id)
            else:
                new = await asyncio.to_thread(self.ctx.queue.submit, "train",
                                              Path(self.job.config),
                                              ["--resume", str(checkpoint)])
        except (ValueError, KeyError) as err:
            ui.notify(str(err), type="negative", multi_line=True)
            return
        ui.navigate.to(f"/run?job={new.id}")


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
