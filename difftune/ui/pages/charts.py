"""ECharts options for the run page's loss chart (NiceGUI's `ui.echart` draws it)."""

from __future__ import annotations

from typing import Any

from difftune.ui.runs import series


def loss_chart_options(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Training loss (raw and smoothed), validation loss where measured, and the learning rate
    on its own axis, against the step (each thinned by `runs.series`, so a long run's chart
    stays light to resend every second)."""
    lines = [
        {"name": "loss", "type": "line", "showSymbol": False, "data": series(rows, "loss"),
         "lineStyle": {"width": 1, "opacity": 0.35}},
        {"name": "loss (smoothed)", "type": "line", "showSymbol": False,
         "data": series(rows, "loss_smoothed"), "lineStyle": {"width": 2}},
        {"name": "validation loss", "type": "line", "symbolSize": 6,
         "data": series(rows, "val_loss")},
        {"name": "learning rate", "type": "line", "showSymbol": False, "yAxisIndex": 1,
         "data": series(rows, "lr"), "lineStyle": {"type": "dashed", "width": 1}},
    ]
    return {
        "animation": False,
        "tooltip": {"trigger": "axis"},
        "legend": {"top": 0},
        "grid": {"left": 60, "right": 70, "top": 40, "bottom": 40},
        "xAxis": {"type": "value", "name": "step", "min": "dataMin"},
        "yAxis": [{"type": "value", "name": "loss", "scale": True},
                  {"type": "value", "name": "lr", "splitLine": {"show": False},
                   "axisLabel": {"formatter": "{value}"}}],
        "series": lines,
    }

