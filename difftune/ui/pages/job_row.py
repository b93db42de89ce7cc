"""One job on the jobs page: its state, its run's name, progress, ETA, last loss, newest
sample, and the actions it offers (an action that cannot work is shown disabled, with why).

A row is built once and then updated in place: the page refreshes every second, and
redrawing would reload each thumbnail and flicker; a part changes only when what it shows
changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlencode

from nicegui import run, ui

from difftune.ui.jobs.progress import Progress, clock
from difftune.ui.pages.layout import error_box
from difftune.ui.pages.states import state_color

if TYPE_CHECKING:
    from difftune.ui.context import UiContext
    from difftune.ui.jobs.store import Job

LABELS = {"stop": "Stop", "kill": "Kill", "resume": "Resume", "requeue": "Requeue",
          "duplicate": "Duplicate"}
GOES_TO_NEW_JOB = ("resume", "requeue", "duplicate")


@dataclass(frozen=True)
class JobView:
    """What a row shows of one job, read off the event loop: the job, its run's progress
    (None for a job that is not a training) and its actions (None: can be taken; else why
    not)."""

    job: "Job"
    progress: Progress | None
    offers: dict[str, str | None]


class JobRow:
    """The row of job `job_id`; `update` shows a new view of it."""

    def __init__(self, ctx: "UiContext", view: JobView) -> None:
        self.ctx, job = ctx, view.job
        self.job_id = job.id
        self.shown: dict[str, Any] = {}
        tid = f"job-{job.id}"
        with ui.card().classes("w-full").props(f'data-testid="{tid}"'):
            with ui.row().classes("w-full items-center gap-3 no-wrap"):
                self.thumb = ui.image().classes("w-16 h-16 shrink-0") \
                    .props(f'fit="contain" data-testid="{tid}-sample"')
                self.badge = ui.badge().props(f'data-testid="{tid}-state"')
                with ui.column().classes("gap-0 grow"):
                    with ui.row().classes("items-baseline gap-2"):
                        self.name = ui.link("", f"/run?job={job.id}") \
                            .classes("font-bold").props(f'data-testid="{tid}-name"')
                        ui.label(f"#{job.id} {job.verb}").classes("text-sm text-gray-600")
                    self.file = ui.label().classes("font-mono text-xs text-gray-500")
                    self.scheduler = ui.label().classes("text-xs text-gray-600") \
                        .props(f'data-testid="{tid}-scheduler"')  # SLURM's word on the job
                self.step = ui.label().props(f'data-testid="{tid}-progress"')
                self.eta = ui.label().props(f'data-testid="{tid}-eta"')
                self.loss = ui.label().props(f'data-testid="{tid}-loss"')
                self.when = ui.label().classes("text-sm text-gray-600")
                self.actions = ui.row().classes("gap-1 no-wrap")
            self.why = ui.column().classes("gap-0 text-sm text-gray-700") \
                .props(f'data-testid="{tid}-why"')
            self.error = ui.column().classes("w-full")
        self.update(view)

    def update(self, view: JobView) -> None:
        """Show `view`, changing only the parts whose content changed."""
        job, p = view.job, view.progress
        self._set("state", job.state, lambda: (self.badge.set_text(job.state),
                                               self.badge.set_background_color(
                                                   state_color(job.state))))
        self._set("name", p.name if p else Path(job.run_dir).name,
                  lambda: self.name.set_text(p.name if p else Path(job.run_dir).name))
        self._set("file", str(job.config), lambda: self.file.set_text(
            self.ctx.roots.relative(Path(job.config))))
        self.step.set_text(f"step {p.step}/{p.total or '?'}" if p else "")
        eta = p.eta_s if p is not None and job.state == "running" else None
        self.eta.set_text(f"ETA {clock(eta)}" if eta else "")
        self.loss.set_text(f"loss {p.loss:.4f}" if p and p.loss is not None else "")
        self.when.set_text(_when(job))
        self.scheduler.set_text(job.scheduler or "")
        sample = p.sample if p else None
        self._set("sample", sample, lambda: self._thumb(sample))
        self._set("offers", tuple(view.offers.items()), lambda: self._actions(view.offers))
        self._set("error", job.error, lambda: self._error(job.error))

    def _set(self, key: str, value: Any, show: Callable[[], Any]) -> None:
        """Call `show` when `value` differs from what the row shows under `key`."""
        if key not in self.shown or self.shown[key] != value:
            self.shown[key] = value
            show()

    def _thumb(self, sample: str | None) -> None:
        self.thumb.set_visibility(sample is not None)
        if sample is not None:
            self.thumb.set_source(f"/api/runs/image?{urlencode({'path': sample})}")

    def _error(self, message: str | None) -> None:
        self.error.clear()
        if message:
            with self.error:
                error_box(message)

    def _actions(self, offers: dict[str, str | None]) -> None:
        """A button per action; one that cannot be taken is disabled and its reason shown
        under the row."""
        self.actions.clear()
        self.why.clear()
        for action, reason in offers.items():
            with self.actions:
                button = ui.button(LABELS[action], on_click=self._handler(action)) \
                    .props(f'flat dense data-testid="job-{self.job_id}-{action}"')
            if reason is not None:
                button.disable()
                with self.why:
                    ui.label(f"{LABELS[action]}: {reason}") \
                        .props(f'data-testid="job-{self.job_id}-why-{action}"')

    def _handler(self, action: str) -> Callable[[], Any]:
        """What pressing `action` does: ask the queue (which refuses what cannot work, with
        the reason, shown), then open the new job's run page."""
        queue = self.ctx.queue
        call = {"stop": queue.stop, "kill": queue.stop, "resume": queue.resume,
                "requeue": queue.requeue, "duplicate": queue.duplicate}[action]

        async def handler() -> None:
            try:
                new = await run.io_bound(call, self.job_id)
            except (ValueError, KeyError, OSError) as err:
                ui.notify(str(err), type="negative", multi_line=True)
                return
            if new is not None and action in GOES_TO_NEW_JOB:
                ui.navigate.to(f"/run?job={new.id}")
        return handler


def _when(job: "Job") -> str:
    """'queued 12 s ago', 'running for 3 min', 'ended 5 min ago'."""
    now = time.time()
    if job.ended:
        return f"ended {_ago(now - job.ended)} ago"
    if job.started:
        return f"running for {_ago(now - job.started)}"
    return f"queued {_ago(now - job.created)} ago" if job.created else ""


def _ago(seconds: float) -> str:
    """A duration in the largest sensible unit."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
