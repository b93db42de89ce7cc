"""The /rank page: the checkpoints of the chosen runs, best first, with their samples side by
side: the same ranking as `difftune runs rank` (verbs/rank.py), computed in a worker thread.

`?runs=` names run folders (comma-separated, under the app's roots), `?by=` the measure (any
save.keep_best expression; default as the CLI's). A problem (a folder outside the roots, an
unknown metric, samples to measure without a DINOv2 folder) is shown as the CLI says it; a
run whose samples must be measured has the paths its config names checked against the roots
first (measuring reads them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from nicegui import run, ui

from difftune.errors import DifftuneError
from difftune.ui.context import UiContext
from difftune.ui.pages.compare import sample_url
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.jobs.paths import check_named_paths
from difftune.ui.security import PathOutsideRoots, Roots
from difftune.verbs.rank import FIGURES, Entry, copy_line, file_names, rank


def rank_url(runs: list[str], by: str = "") -> str:
    """The /rank page of these run folders (and measure)."""
    query = f"runs={quote(','.join(runs), safe='/,')}"
    return f"/rank?{query}" + (f"&by={quote(by, safe='')}" if by else "")


def ranked(roots: Roots, folders: list[Path], by: str | None) -> tuple[str, list[Entry]]:
    """`difftune runs rank` of `folders`; a run whose samples must be measured first has the
    paths its config.resolved.json names checked against `roots` (PathOutsideRoots naming the
    field): measuring reads its model files, training images and metric models."""
    def check(folder: Path, cfg: dict[str, Any]) -> None:
        check_named_paths(cfg, folder, roots, lambda field, value: (
            f"{field} = {value} in {folder / 'config.resolved.json'}"))

    return rank(folders, by, check=check)


def register(ctx: UiContext) -> None:
    """Define the /rank page."""

    @ui.page("/rank")
    async def rank_page(runs: str = "", by: str = "") -> None:
        with frame("Rank checkpoints"):
            names = [p.strip() for p in runs.split(",") if p.strip()]
            try:
                folders = [ctx.roots.resolve(n) for n in names]
            except PathOutsideRoots as err:
                error_box(str(err))
                return
            if not folders:
                error_box("choose runs to rank: /rank?runs=RUN_FOLDER,... (or open them from "
                          "the compare page)")
                return
            with ui.row().classes("w-full items-end gap-4"):
                measure = ui.input("rank by", value=by, placeholder="fidelity, val_loss, "
                                   "0.7*fidelity + 0.3*clip_score/100").classes("grow") \
                    .props('data-testid="rank-by"')
                ui.button("Rank", on_click=lambda: ui.navigate.to(
                    rank_url(names, measure.value or ""))).props('data-testid="rank-go"')
            try:
                used, entries = await run.io_bound(ranked, ctx.roots, folders, by or None)
            except (DifftuneError, PathOutsideRoots) as err:
                error_box(str(err))
                return
            measure.value = used
            _show(ctx, used, entries)


def _show(ctx: UiContext, by: str, entries: list[Entry]) -> None:
    """One row a checkpoint: its place, run, step, score and figures, and its samples."""
    for i, e in enumerate(entries):
        with ui.card().classes("w-full p-2").props(f'data-testid="rank-entry-{i}"'):
            place = f"#{i + 1}" if e.score is not None else "unmeasured"
            score = f"{by} = {e.score:.4f}" if e.score is not None else ""
            ui.label(f"{place} · {ctx.roots.relative(Path(e.run))} · step {e.step} · {score}") \
                .classes("font-bold").props(f'data-testid="rank-title-{i}"')
            figures = " · ".join(f"{k} {e.figures[k]:.4f}" for k in FIGURES if k in e.figures)
            ui.label(f"{figures} · {file_names(e)}").classes("text-xs text-gray-600") \
                .props(f'data-testid="rank-files-{i}"')
            copying = copy_line(e)
            if copying:  # memorization, as `difftune runs rank` shows it
                ui.label(("⚠ " if e.copying else "") + copying) \
                    .classes("text-sm " + ("text-red-700 font-bold" if e.copying
                                           else "text-gray-600")) \
                    .props(f'data-testid="rank-copying-{i}"')
            with ui.row().classes("gap-2"):
                for j, path in enumerate(e.samples):
                    ui.image(sample_url(path)).classes("w-32") \
                        .props(f'data-testid="rank-sample-{i}-{j}"')
