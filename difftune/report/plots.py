"""Small PIL-only figures (no plotting dependency): the loss curve and labelled image sheets."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw


def read_metric(path: Path, key: str = "loss") -> list[tuple[int, float]]:
    """(step, value) pairs of one metric from a metrics.jsonl file."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if key in row:
                rows.append((int(row["step"]), float(row[key])))
    return rows


def _polyline(draw: ImageDraw.ImageDraw, pts: list[tuple[int, float]], box: tuple[int, int, int, int],
              span: tuple[int, int, float, float], color: str, width: int) -> None:
    left, top, right, bottom = box
    x0, x1, y0, y1 = span
    xy = [(left + (x - x0) / max(1, x1 - x0) * (right - left),
           bottom - (y - y0) / max(1e-12, y1 - y0) * (bottom - top)) for x, y in pts]
    if len(xy) > 1:
        draw.line(xy, fill=color, width=width)


def loss_curve(metrics: Path, out: Path, size: tuple[int, int] = (640, 360)) -> Path:
    """Draw raw (light) and smoothed (dark) loss against step, and the validation loss (red,
    with a dot per evaluation) where the run measured it; returns the PNG path."""
    raw = read_metric(metrics, "loss")
    smooth = read_metric(metrics, "loss_smoothed")
    val = read_metric(metrics, "val_loss")
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    box = (60, 30, size[0] - 20, size[1] - 40)
    if raw:
        values = [v for _, v in raw + val]
        span = (raw[0][0], raw[-1][0], min(values), max(values))
        draw.rectangle(box, outline="black")
        _polyline(draw, raw, box, span, "#9ecae1", 1)
        _polyline(draw, smooth, box, span, "#08519c", 2)
        _polyline(draw, val, box, span, "#cb181d", 2)
        for x, y in val:
            _dot(draw, x, y, box, span)
        draw.text((box[0], box[3] + 8), f"step {span[0]}", fill="black")
        draw.text((box[2] - 70, box[3] + 8), f"step {span[1]}", fill="black")
        draw.text((4, box[1]), f"{span[3]:.3f}", fill="black")
        draw.text((4, box[3] - 10), f"{span[2]:.3f}", fill="black")
    title = "training loss (light: per step, dark: smoothed)"
    draw.text((box[0], 8), title + (", validation (red)" if val else ""), fill="black")
    img.save(out)
    return out


def _dot(draw: ImageDraw.ImageDraw, x: float, y: float, box: tuple[int, int, int, int],
         span: tuple[int, int, float, float]) -> None:
    left, top, right, bottom = box
    px = left + (x - span[0]) / max(1, span[1] - span[0]) * (right - left)
    py = bottom - (y - span[2]) / max(1e-12, span[3] - span[2]) * (bottom - top)
    draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill="#cb181d")


def loss_by_timestep(by_t: dict[str, float], out: Path, title: str,
                     size: tuple[int, int] = (480, 300)) -> Path:
    """A bar per fixed timestep (clean on the left, noisy on the right) with its loss
    written above; returns the PNG path."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    box = (20, 40, size[0] - 20, size[1] - 30)
    draw.text((box[0], 8), title, fill="black")
    top = max(list(by_t.values()) + [1e-12])
    width = (box[2] - box[0]) / max(1, len(by_t))
    for k, (t, value) in enumerate(by_t.items()):
        x0 = box[0] + k * width + 4
        y0 = box[3] - (value / top) * (box[3] - box[1] - 14)
        draw.rectangle((x0, y0, x0 + width - 8, box[3]), fill="#cb181d")
        draw.text((x0, y0 - 12), f"{value:.4g}", fill="black")
        draw.text((x0, box[3] + 6), f"t={t}", fill="black")
    img.save(out)
    return out


def labelled_rows(rows: list[tuple[str, Image.Image]], out: Path) -> Path:
    """Stack image rows vertically, each with a label on its left; returns the PNG path."""
    label_w = 80
    width = label_w + max(im.width for _, im in rows)
    height = sum(im.height for _, im in rows)
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    y = 0
    for label, im in rows:
        sheet.paste(im, (label_w, y))
        draw.text((6, y + im.height // 2 - 5), label, fill="black")
        y += im.height
    sheet.save(out)
    return out
