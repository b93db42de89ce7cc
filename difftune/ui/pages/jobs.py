"""The jobs page ("/"): the queue as the database and the processes say it is, with actions.

Every row is re-derived from the job's process and run folder on each refresh (the queue's
`list()`), so a job whose process died shows as died or failed with the CLI's message, never
as running. A training's row shows its run by name with its progress, ETA, last loss and
newest sample (job_row.py); actions that cannot work are disabled, with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nicegui import run, ui

from difftune.ui.jobs import rules
from difftune.ui.jobs.progress import progress
from difftune.ui.jobs.store import VERBS
from difftune.ui.pages.job_row import JobRow, JobView
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.security import PathOutsideRoots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext


def register(ctx: "UiContext") -> None:
    """Define the "/" page."""

    @ui.page("/")
    def jobs_page() -> None:
        with frame("Jobs"):
            _submit_form(ctx)
            table = ui.column().classes("w-full gap-2").props('data-testid="jobs"')
            jobs = JobsList(ctx, table)
            jobs.show(*jobs.read())  # in the page as served; then refreshed off the event loop
            ui.timer(1.0, jobs.refresh)


def _submit_form(ctx: "UiContext") -> None:
    """A run file path and a verb: queue a job (the form on /prepare makes run files)."""
    with ui.row().classes("w-full items-end gap-2"):
        config = ui.input("Run file (.toml, under the roots)").classes("grow") \
            .props('data-testid="submit-config"')
        verb = ui.select(list(VERBS), value="train", label="Verb") \
            .props('data-testid="submit-verb"')
        device = ui.input("Device", value="default") \
            .tooltip("default, cpu, cuda:N, or slurm:NxG@PARTITION to send a training to "
                     "SLURM (N nodes, G GPUs each)").props('data-testid="submit-device"')
        message = ui.label().classes("text-red-700").props('data-testid="submit-error"')

        async def submit() -> None:
            message.text = ""
            try:
                path = ctx.roots.resolve(config.value.strip())
                job = await run.io_bound(ctx.queue.submit, verb.value, path, (),
                                         device.value.strip() or "default")
            except (PathOutsideRoots, ValueError, OSError) as err:
                message.text = str(err)
                return
            ui.navigate.to(f"/run?job={job.id}")

        ui.button("Queue", on_click=submit).props('data-testid="submit"')


class JobsList:
    """The job rows of one open page: built once per job, then updated in place."""

    def __init__(self, ctx: "UiContext", box: ui.column) -> None:
        self.ctx, self.box = ctx, box
        self.rows: dict[int, JobRow] = {}
        self.order: list[int] | None = None
        self.report: str | None = None
        self.busy = False

    async def refresh(self) -> None:
        """Read the jobs off the event loop, then show them (one refresh at a time)."""
        if self.busy:
            return
        self.busy = True
        try:
            read = await run.io_bound(self.read)
            if read is not None:  # None: the page was closed while reading
                self.show(*read)
        finally:
            self.busy = False

    def read(self) -> tuple[list[JobView], str | None]:
        """Every job (newest first), derived now, with its run's progress and its actions."""
        queue = self.ctx.queue
        jobs = queue.list()
        unfinished = [job for job in jobs if not job.finished]
        views = [JobView(job, progress(job.run_dir, self.ctx.roots) if job.verb == "train"
                         else None, rules.offers(job, unfinished, self.ctx.roots))
                 for job in jobs]
        return views, queue.store.unreadable_report()

    def show(self, views: list[JobView], report: str | None) -> None:
        """Update each row; rebuild the list only when jobs came or went."""
        order = [view.job.id for view in views]
        if order != self.order or report != self.report:
            self.order, self.report = order, report
            self.box.clear()
            self.rows = {}
            with self.box:
                if report is not None:
                    error_box(report)
                if not views:
                    ui.label("No jobs yet: make a run on 'New run', or queue a run file above.")
                for view in views:
                    self.rows[view.job.id] = JobRow(self.ctx, view)
            return
        for view in views:
            self.rows[view.job.id].update(view)
