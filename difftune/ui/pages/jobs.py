"""The jobs page ("/"): the queue as the database and the processes say it is, with actions.

Every row is re-derived from the job's process and run folder on each refresh (the queue's
`list()`), so a job whose process died shows as died or failed with the CLI's message, never
as running.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from nicegui import run, ui

from difftune.ui.pages.layout import error_box, frame
from difftune.ui.security import PathOutsideRoots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext
    from difftune.ui.jobs.store import Job

VERBS = ("train", "check", "cache", "sample")
FINISHED = {"succeeded", "failed", "stopped", "cancelled", "died"}
COLORS = {"queued": "grey", "running": "primary", "stopping": "orange", "succeeded": "positive",
          "failed": "negative", "died": "negative", "stopped": "warning", "cancelled": "grey"}


def register(ctx: "UiContext") -> None:
    """Define the "/" page."""

    @ui.page("/")
    def jobs_page() -> None:
        with frame("Jobs"):
            _submit_form(ctx)
            table = ui.column().classes("w-full gap-2").props('data-testid="jobs"')
            _refresh(ctx, table)
            ui.timer(1.0, lambda: _refresh(ctx, table))


def _submit_form(ctx: "UiContext") -> None:
    """A run file path and a verb: queue a job (the form on /prepare makes run files)."""
    with ui.row().classes("w-full items-end gap-2"):
        config = ui.input("Run file (.toml, under the roots)").classes("grow") \
            .props('data-testid="submit-config"')
        verb = ui.select(list(VERBS), value="train", label="Verb") \
            .props('data-testid="submit-verb"')
        message = ui.label().classes("text-red-700").props('data-testid="submit-error"')

        async def submit() -> None:
            message.text = ""
            try:
                path = ctx.roots.resolve(config.value.strip())
                job = await run.io_bound(ctx.queue.submit, verb.value, path)
            except (PathOutsideRoots, ValueError, OSError) as err:
                message.text = str(err)
                return
            ui.navigate.to(f"/run?job={job.id}")

        ui.button("Queue", on_click=submit).props('data-testid="submit"')


def _refresh(ctx: "UiContext", box: ui.column) -> None:
    """Redraw the job rows from the queue (newest first)."""
    box.clear()
    jobs = ctx.queue.list()
    with box:
        report = ctx.queue.store.unreadable_report()
        if report is not None:
            error_box(report)
        if not jobs:
            ui.label("No jobs yet: make a run on 'New run', or queue a run file above.")
        for job in jobs:
            _job_row(ctx, job)


def _job_row(ctx: "UiContext", job: "Job") -> None:
    """One job: state, what it runs, its error (the CLI's message) and its actions."""
    with ui.card().classes("w-full").props(f'data-testid="job-{job.id}"'):
        with ui.row().classes("w-full items-center gap-3"):
            ui.badge(job.state, color=COLORS.get(job.state, "grey")) \
                .props(f'data-testid="job-{job.id}-state"')
            ui.link(f"#{job.id} {job.verb}", f"/run?job={job.id}").classes("font-bold")
            ui.label(ctx.roots.relative(Path(job.config))).classes("font-mono text-sm grow")
            ui.label(_when(job)).classes("text-sm text-gray-600")
            for label, action in _actions(ctx, job):
                ui.button(label, on_click=action).props(
                    f'flat dense data-testid="job-{job.id}-{label.lower()}"')
        if job.error:
            error_box(job.error)


def _actions(ctx: "UiContext", job: "Job") -> list[tuple[str, Callable[[], Any]]]:
    """The buttons that make sense for the job's state."""
    def act(fn: Callable[[int], "Job"], goto: bool) -> Callable[[], Any]:
        async def handler() -> None:
            try:
                new = await run.io_bound(fn, job.id)
            except (ValueError, KeyError) as err:
                ui.notify(str(err), type="negative", multi_line=True)
                return
            if goto:
                ui.navigate.to(f"/run?job={new.id}")
        return handler

    out: list[tuple[str, Callable[[], Any]]] = []
    if job.state in ("queued", "running"):
        out.append(("Stop", act(ctx.queue.stop, False)))
    if job.state == "stopping":  # it did not stop on SIGTERM: a second press kills it
        out.append(("Kill", act(ctx.queue.stop, False)))
    if job.state in ("stopped", "failed", "died") and job.verb == "train" and job.checkpoints:
        out.append(("Resume", act(ctx.queue.resume, True)))
    if job.state in FINISHED:
        out.append(("Requeue", act(ctx.queue.requeue, True)))
    out.append(("Duplicate", act(ctx.queue.duplicate, True)))
    return out


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
