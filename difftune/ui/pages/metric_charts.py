"""Sample metrics in the web app: a chart (run page, compare page) and the per-checkpoint table.

The rows are metrics.jsonl's sample-event rows (`runs.sample_metrics`): fidelity, diversity and
the nearest-training-image similarity are cosines (left axis), the CLIP score is 0-100 (right
axis). A row with a sample as similar to a training image as its copy floor is marked.
"""

from __future__ import annotations

from typing import Any

from nicegui import ui

from difftune.ui import run_outputs as outputs
from difftune.ui.runs import series

# (key, label, dashed) of each charted metric.
CHARTED = (("fidelity", "fidelity", False), ("diversity", "diversity", True),
           ("nearest_similarity", "nearest training image", True))
# One colour per run (or per metric, for one run): ECharts' default palette, in its order.
PALETTE = ("#5470c6", "#91cc75", "#fac858", "#ee6666", "#73c0de", "#3ba272", "#fc8452",
           "#9a60b4", "#ea7ccc")


def sample_chart_options(events: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """ECharts options: per run (label -> sample-metrics rows) each metric against the step;
    one colour a run (one run: one colour a metric)."""
    lines = []
    for r, (label, rows) in enumerate(events.items()):
        prefix = f"{label} · " if len(events) > 1 else ""
        for m, (key, name, dashed) in enumerate((*CHARTED, ("clip_score", "CLIP score", False))):
            data = series(rows, key)
            if not data:
                continue
            colour = PALETTE[(r if len(events) > 1 else m) % len(PALETTE)]
            lines.append({"name": f"{prefix}{name}", "type": "line", "data": data,
                          "symbolSize": 6, "itemStyle": {"color": colour},
                          "yAxisIndex": 1 if key == "clip_score" else 0,
                          "lineStyle": {"type": "dashed" if dashed or key == "clip_score"
                                        and len(events) > 1 else "solid"}})
    return {"animation": False, "tooltip": {"trigger": "axis"},
            "legend": {"type": "scroll", "top": 0},
            "grid": {"left": 60, "right": 70, "top": 40, "bottom": 40},
            "xAxis": {"type": "value", "name": "step", "min": "dataMin"},
            "yAxis": [{"type": "value", "name": "similarity", "scale": True},
                      {"type": "value", "name": "CLIP score", "scale": True,
                       "splitLine": {"show": False}}],
            "series": lines}


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "–"


def table_rows(events: list[dict[str, Any]], files: list[outputs.RunFile]) -> list[dict]:
    """One row a measured step: its figures and the checkpoint or LoRA file saved there."""
    at = {}
    for f in files:
        if f.step is not None and (f.kind == "checkpoint" or f.step not in at):
            at[f.step] = f.path.rsplit("/", 1)[-1]
    last = max((e["step"] for e in events), default=None)
    final = next((f.path.rsplit("/", 1)[-1] for f in files if f.final), None)
    return [{"step": e["step"], "fidelity": _fmt(e.get("fidelity")),
             "clip_score": _fmt(e.get("clip_score")), "diversity": _fmt(e.get("diversity")),
             "nearest": _fmt(e.get("nearest_similarity")),
             "copying": "copying" if e.get("copying") else "",
             "checkpoint": at.get(e["step"]) or (final if e["step"] == last else "") or ""}
            for e in events]


COLUMNS = [{"name": k, "label": label, "field": k, "align": "left"} for k, label in (
    ("step", "step"), ("fidelity", "fidelity"), ("clip_score", "CLIP score"),
    ("diversity", "diversity"), ("nearest", "nearest training image"), ("copying", ""),
    ("checkpoint", "checkpoint"))]


class SampleMetricsPanel:
    """The run page's sample metrics: the chart and the table (hidden until a row exists)."""

    def __init__(self) -> None:
        self.box = ui.column().classes("w-full")
        self.box.set_visibility(False)
        with self.box:
            ui.label("Sample metrics").classes("text-xl")
            self.chart = ui.echart(sample_chart_options({})).classes("w-full h-72") \
                .props('data-testid="sample-metrics-chart"')
            self.table = ui.table(columns=COLUMNS, rows=[], row_key="step") \
                .classes("w-full").props('dense data-testid="sample-metrics-table"')

    def update(self, events: list[dict[str, Any]], files: list[outputs.RunFile]) -> None:
        """Show these rows (the page calls it when they changed)."""
        self.box.set_visibility(bool(events))
        self.chart.options.clear()
        self.chart.options.update(sample_chart_options({"run": events}))
        self.chart.update()
        self.table.rows = table_rows(events, files)
        self.table.update()
