"""The /compare page: pick runs, see their loss curves on one chart (smoothed training loss,
raw loss on request, validation loss where a run has it), and their samples of one prompt at
one step side by side.

It reads the run folders with difftune/ui/runs.py, as /api/runs does; sample images are shown
through /api/runs/image, so they pass the same roots check. The chart is refreshed every few
seconds, so a run still training keeps drawing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from nicegui import run, ui

from difftune.ui import run_outputs as outputs
from difftune.ui import runs as readers
from difftune.ui.context import UiContext
from difftune.ui.pages.layout import frame
from difftune.ui.pages.metric_charts import PALETTE, sample_chart_options
from difftune.ui.security import PathOutsideRoots

REFRESH_S = 5.0


def sample_url(path: str) -> str:
    """The URL of a sample image (through the API's roots check)."""
    return f"/api/runs/image?path={quote(path, safe='')}"


def register(ctx: UiContext) -> None:
    """Define the /compare page (`?runs=` run folders to preselect, comma-separated)."""

    @ui.page("/compare")
    async def compare_page(runs: str = "") -> None:
        with frame("Compare runs"):
            view = CompareView(ctx)
            await view.load([p for p in runs.split(",") if p.strip()])


def loss_chart(curves: dict[str, list[dict[str, Any]]], raw: bool) -> dict[str, Any]:
    """ECharts options: per run (label -> metrics rows) its smoothed loss, its validation loss
    where it has one (dashed, with points), and its raw loss when `raw`."""
    series = []
    for i, (label, rows) in enumerate(curves.items()):
        colour = {"color": PALETTE[i % len(PALETTE)]}
        series.append({"name": f"{label} · loss (smoothed)", "type": "line", "showSymbol": False,
                       "data": readers.series(rows, "loss_smoothed"), "itemStyle": colour})
        if raw:
            series.append({"name": f"{label} · loss", "type": "line", "showSymbol": False,
                           "lineStyle": {"width": 1, "opacity": 0.4}, "itemStyle": colour,
                           "data": readers.series(rows, "loss")})
        val = readers.series(rows, "val_loss")
        if val:
            series.append({"name": f"{label} · val_loss", "type": "line", "data": val,
                           "lineStyle": {"type": "dashed"}, "symbolSize": 6,
                           "itemStyle": colour})
    return {"animation": False, "tooltip": {"trigger": "axis"},
            "legend": {"type": "scroll", "top": 0},
            "grid": {"left": 60, "right": 20, "top": 40, "bottom": 40},
            "xAxis": {"type": "value", "name": "step", "nameLocation": "middle", "nameGap": 25},
            "yAxis": {"type": "value", "name": "loss", "scale": True},
            "series": series}


def metric_line(events: list[dict[str, Any]], step: int, sample: str) -> str:
    """The sample metrics of the prompt of one sample file at one step, as one line ("" when
    unmeasured); the file names the prompt (the page may know only its slug)."""
    row = next((e for e in events if e["step"] == step), None)
    details = (row or {}).get("sample_metrics") or {}
    name = Path(sample).name
    prompt = next((s["prompt"] for s in details.get("samples", []) if s.get("file") == name),
                  None)
    figures = (details.get("prompts") or {}).get(prompt)
    if not figures:
        return ""
    names = (("fidelity", "fidelity"), ("clip_score", "CLIP"), ("diversity", "diversity"))
    return " · ".join(f"{label} {figures[k]:.3f}" for k, label in names
                      if isinstance(figures.get(k), float))


class CompareView:
    """The run picker, the chart, and the side-by-side samples."""

    def __init__(self, ctx: UiContext) -> None:
        self.ctx = ctx
        self.samples: dict[str, list[outputs.SampleImage]] = {}
        with ui.row().classes("w-full items-end gap-4"):
            self.picker = ui.select({}, label="Runs", multiple=True, with_input=True,
                                    on_change=self.refresh).classes("grow") \
                .props('use-chips data-testid="compare-runs"')
            self.raw = ui.checkbox("raw loss", on_change=self.refresh_chart) \
                .props('data-testid="compare-raw"')
            ui.button("Rank checkpoints", on_click=self.open_ranking) \
                .props('flat data-testid="compare-rank"')
        self.chart = ui.echart(loss_chart({}, False)).classes("w-full h-96") \
            .props('data-testid="compare-chart"')
        self.metrics_chart = ui.echart(sample_chart_options({})).classes("w-full h-72") \
            .props('data-testid="compare-metrics-chart"')
        self.metrics_chart.set_visibility(False)
        self.events: dict[str, list[dict[str, Any]]] = {}
        with ui.row().classes("w-full items-end gap-4"):
            self.prompt = ui.select([], label="Prompt", on_change=self.show_samples) \
                .classes("grow").props('data-testid="compare-prompt"')
            self.step = ui.select([], label="Step", on_change=self.show_samples) \
                .classes("w-40").props('data-testid="compare-step"')
        self.row = ui.row().classes("w-full gap-4 items-start") \
            .props('data-testid="compare-samples"')
        ui.timer(REFRESH_S, self.refresh_chart)

    def open_ranking(self) -> None:
        """The /rank page of the chosen runs (their checkpoints best first, with samples)."""
        chosen = [self.label(p) for p in self.picker.value or []]
        ui.navigate.to("/rank?runs=" + quote(",".join(chosen), safe="/,"))

    def label(self, path: str) -> str:
        """A run as users see it: its folder relative to its root."""
        return self.ctx.roots.relative(Path(path))

    async def load(self, preselect: list[str]) -> None:
        """Fill the picker with the runs under the roots; select those `preselect` names."""
        found = await run.io_bound(readers.find_runs, self.ctx.roots)
        options = {r.path: f"{self.label(r.path)} ({r.step}/{r.total_steps or '?'})"
                   for r in found}
        chosen = []
        for name in preselect:
            try:
                path = str(self.ctx.roots.resolve(name.strip()))
            except PathOutsideRoots:
                continue
            if path in options:
                chosen.append(path)
        self.picker.set_options(options, value=chosen)
        if chosen:
            await self.refresh()

    async def refresh(self) -> None:
        """Re-read the chosen runs' metrics and samples, then redraw everything."""
        await self.refresh_chart()
        chosen = list(self.picker.value or [])
        roots = self.ctx.roots
        self.samples = {p: await run.io_bound(outputs.samples, Path(p), roots) for p in chosen}
        prompts = list(dict.fromkeys(s.prompt for found in self.samples.values() for s in found))
        steps = sorted({s.step for found in self.samples.values() for s in found
                        if s.step is not None})
        shared = [st for st in steps if all(any(s.step == st for s in found)
                                            for found in self.samples.values())]
        self.prompt.set_options(prompts, value=self.prompt.value if self.prompt.value in prompts
                                else (prompts[0] if prompts else None))
        self.step.set_options(steps, value=self.step.value if self.step.value in steps
                              else (shared or steps or [None])[-1])
        self.show_samples()

    async def refresh_chart(self) -> None:
        """Redraw the loss chart of the chosen runs (metrics are read incrementally)."""
        chosen = list(self.picker.value or [])
        curves = {self.label(p): await run.io_bound(readers.metrics, Path(p), 0, self.ctx.roots)
                  for p in chosen}
        self.chart.options.clear()
        self.chart.options.update(loss_chart(curves, bool(self.raw.value)))
        self.chart.update()
        self.events = {p: await run.io_bound(readers.sample_metrics, Path(p), self.ctx.roots)
                       for p in chosen}
        shown = {self.label(p): rows for p, rows in self.events.items() if rows}
        self.metrics_chart.set_visibility(bool(shown))
        self.metrics_chart.options.clear()
        self.metrics_chart.options.update(sample_chart_options(shown))
        self.metrics_chart.update()

    def show_samples(self) -> None:
        """Each chosen run's sample of the chosen prompt at the chosen step, side by side."""
        self.row.clear()
        prompt, step = self.prompt.value, self.step.value
        if prompt is None or step is None:
            return
        with self.row:
            for i, (path, found) in enumerate(self.samples.items()):
                match = next((s for s in found if s.prompt == prompt and s.step == step), None)
                with ui.card().classes("w-64 p-2 gap-1").props(f'data-testid="compare-card-{i}"'):
                    ui.label(self.label(path)).classes("text-sm font-bold")
                    if match is None:
                        ui.label(f"no sample of this prompt at step {step}") \
                            .classes("text-xs text-gray-600")
                        continue
                    ui.image(sample_url(match.path)).classes("w-full") \
                        .props(f'data-testid="compare-sample-{i}"')
                    ui.label(f"step {step} · {prompt}").classes("text-xs text-gray-600")
                    figures = metric_line(self.events.get(path, []), step, match.path)
                    if figures:
                        ui.label(figures).classes("text-xs").props(
                            f'data-testid="compare-metrics-{i}"')
