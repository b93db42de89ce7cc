"""The /sweep page (`?path=SWEEP_FOLDER`): a `difftune sweep` study's table, as the sweep keeps
it in `<save.dir>/sweep.json`: each trial's state, settings, value and best checkpoint, its run
page a click away, and the chosen trials opened side by side in the compare page."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from nicegui import ui

from difftune.ui.context import UiContext
from difftune.ui.pages.layout import error_box, frame
from difftune.ui.runs import json_object, readable
from difftune.ui.security import PathOutsideRoots

REFRESH_S = 5.0
COLUMNS = [{"name": k, "label": label, "field": k, "align": "left"} for k, label in (
    ("trial", "trial"), ("state", "state"), ("params", "settings"), ("value", "value"),
    ("best", "best checkpoint"))]


def study_rows(folder: Path, ctx: UiContext) -> tuple[str, list[dict[str, Any]]]:
    """The study's metric and table rows (shown relative to the roots)."""
    path = readable(folder / "sweep.json", folder, ctx.roots)
    doc = json_object(path) if path is not None else {}
    rows = []
    for t in doc.get("trials", []) if isinstance(doc.get("trials"), list) else []:
        value = t.get("value")
        rows.append({"trial": t.get("trial"), "state": t.get("state"),
                     "params": ", ".join(f"{k} = {v}" for k, v in (t.get("params") or {}).items()),
                     "value": f"{value:.6g}" if isinstance(value, (int, float)) else "–",
                     "best": (f"step {t['best_step']}: {Path(t['best_file']).name}"
                              if t.get("best_file") else ""),
                     "run": ctx.roots.relative(Path(t.get("run_dir", "")))})
    return str(doc.get("metric", "")), rows


def register(ctx: UiContext) -> None:
    """Define the /sweep page."""

    @ui.page("/sweep")
    def sweep_page(path: str = "") -> None:
        with frame("Sweep"):
            try:
                folder = ctx.roots.resolve(path)
            except (PathOutsideRoots, ValueError) as err:
                error_box(str(err))
                return
            metric = ui.label().props('data-testid="sweep-metric"')
            table = ui.table(columns=COLUMNS, rows=[], row_key="trial", selection="multiple") \
                .classes("w-full").props('data-testid="sweep-table"')
            table.on("row-click", lambda e: ui.navigate.to(
                f"/run?path={quote(e.args[1]['run'], safe='/')}"))

            def compare() -> None:
                chosen = [r["run"] for r in table.selected] or [r["run"] for r in table.rows]
                ui.navigate.to("/compare?runs=" + quote(",".join(chosen), safe="/,"))

            ui.button("Compare trials", on_click=compare).props('data-testid="sweep-compare"')

            def refresh() -> None:
                name, rows = study_rows(folder, ctx)
                metric.text = f"{folder.name}: trials judged by {name}" if name else \
                    f"{folder} holds no sweep.json yet (difftune sweep writes it)"
                if rows != table.rows:
                    table.rows = rows
                    table.update()

            refresh()
            ui.timer(REFRESH_S, refresh)
