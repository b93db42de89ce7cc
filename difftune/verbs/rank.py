"""`difftune runs rank RUN_FOLDER...`: the checkpoints of one or more runs, best first.

A checkpoint is a step with a saved LoRA (`checkpoints/step-N`, `<name>-stepN.safetensors`, the
final `<name>.safetensors`); of a two-expert model (Wan 2.2 A14B), the pair of files one save
writes (`<name>_high_noise` and `<name>_low_noise`), both listed. Its figures are what
metrics.jsonl holds for that step (the validation loss, the sample metrics); where samples of that step were saved but never measured
(a run without `[metrics]`), they are measured now from the PNGs, with the run's metric models
or the ones given (`--dino`, `--clip`). The measure is any keep_best expression (`--by`; default:
the run's save.keep_best, else fidelity where measured, else val_loss).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from difftune.config.experts import file_suffixes
from difftune.config.keep_best import SAMPLE_METRICS, Measure
from difftune.errors import ConfigError

STEP_DIR = re.compile(r"^step-(\d+)$")
STEP_FILE = re.compile(r"-step(\d+)\.safetensors$")
FIGURES = ("val_loss", "fidelity", "clip_score", "diversity", "nearest_similarity")


@dataclass
class Entry:
    """One checkpoint of one run: its LoRA file, figures, score (None: unmeasured), samples.
    `files` are all its LoRA files (a two-expert model's pair, `file` the first of them)."""

    run: str
    step: int
    file: str
    files: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    score: float | None = None
    samples: list[str] = field(default_factory=list)
    measured_now: bool = False
    copying: bool | None = None  # its samples look copied (None: not measured)
    # The sample closest to a copy: {"sample", "nearest" (training image), "similarity",
    # "floor" (that image's copy floor)}; None where no per-sample figures were kept.
    closest: dict[str, Any] | None = None


def read_rows(run: Path) -> list[dict[str, Any]]:
    """The complete rows of a run's metrics.jsonl (training steps and sample events)."""
    path = run / "metrics.jsonl"
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _config(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "config.resolved.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{run} is not a run folder (config.resolved.json: {err}); pass a "
                          "run's save.dir") from None


def checkpoints(run: Path, cfg: dict[str, Any], rows: list[dict[str, Any]]
                ) -> dict[int, list[Path]]:
    """Every step with a saved LoRA, and its files (a step's own before a checkpoint's): of a
    two-expert model, the pair one save writes (the first expert's file, then the other's,
    where it exists)."""
    name = cfg.get("save", {}).get("name", "lora")
    suffix, *others = file_suffixes(cfg)  # a pair is found by its first file
    found: dict[int, Path] = {}
    ckpts = run / "checkpoints"
    for folder in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
        m = STEP_DIR.match(folder.name)
        if m and (folder / f"{name}{suffix}.safetensors").is_file():
            found[int(m.group(1))] = folder / f"{name}{suffix}.safetensors"
    for path in sorted(run.glob(f"{name}-step*{suffix}.safetensors")):
        stem = path.name.removesuffix(f"{suffix}.safetensors")
        if (m := STEP_FILE.search(f"{stem}.safetensors")) and not stem.endswith("-comfyui"):
            found[int(m.group(1))] = path
    final = run / f"{name}{suffix}.safetensors"
    steps = [r["step"] for r in rows if "loss" in r]
    if final.is_file():
        found[max(steps) if steps else int(cfg.get("train", {}).get("steps", 0))] = final
    return {step: [path, *_partners(path, suffix, others)] for step, path in found.items()}


def _partners(first: Path, suffix: str, others: list[str]) -> list[Path]:
    """The files saved with `first` (whose stem ends in `suffix`) of the other experts, those
    that exist."""
    stem = first.name.removesuffix(f"{suffix}.safetensors")
    return [p for s in others if (p := first.with_name(f"{stem}{s}.safetensors")).is_file()]


def _figures(rows: list[dict[str, Any]], step: int) -> dict[str, float]:
    """What metrics.jsonl measured at `step` (the last row of each kind wins)."""
    out: dict[str, float] = {}
    for row in rows:
        if row["step"] == step:
            out.update({k: float(row[k]) for k in FIGURES if isinstance(row.get(k), (int, float))
                        and not isinstance(row.get(k), bool)})
    return out


def _copying(rows: list[dict[str, Any]], step: int) -> bool | None:
    """Whether the sample event at `step` looked copied (None: no event measured there)."""
    found = None
    for row in rows:
        if row["step"] == step and isinstance(row.get("copying"), bool):
            found = row["copying"]
    return found


def _closest(samples: Any) -> dict[str, Any] | None:
    """Of an event's per-sample figures, the sample nearest to being a copy: the one whose
    similarity to its nearest training image is furthest past (or least short of) that
    image's copy floor (None when the figures are missing)."""
    keys = ("file", "nearest", "nearest_similarity", "copy_floor")
    rows = [r for r in samples if isinstance(r, dict) and all(k in r for k in keys)] \
        if isinstance(samples, list) else []
    if not rows:
        return None
    top = max(rows, key=lambda r: float(r["nearest_similarity"]) - float(r["copy_floor"]))
    return {"sample": str(top["file"]), "nearest": str(top["nearest"]),
            "similarity": float(top["nearest_similarity"]), "floor": float(top["copy_floor"])}


def _event_closest(rows: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    """`_closest` of the last sample event measured at `step` (None: none there)."""
    found = None
    for row in rows:
        if row["step"] == step and isinstance(row.get("sample_metrics"), dict):
            found = _closest(row["sample_metrics"].get("samples"))
    return found


def copy_line(e: Entry) -> str | None:
    """The memorization figure of a checkpoint in words (None: not measured): whether its
    samples copy a training image, which one, and the similarity against its copy floor."""
    if e.copying is None:
        return None
    head = "copying" if e.copying else "not copying"
    if e.closest is None:
        return head
    c = e.closest
    return (f"{head}: {c['sample']} has similarity {c['similarity']:.4f} to training image "
            f"{c['nearest']} (its copy floor {c['floor']:.4f})")


def _samples(run: Path, step: int) -> list[Path]:
    return sorted(p for p in (run / "samples").glob(f"step-{step:06d}_*.png")
                  if not p.name.endswith("_grid.png"))


class Measurer:
    """Measures saved samples of a run that metrics.jsonl lacks (models loaded once a run)."""

    def __init__(self, dino: Path | None, clip: Path | None,
                 check: Callable[[Path, dict[str, Any]], None] | None = None) -> None:
        self.dino, self.clip, self.check = dino, clip, check

    def measure(self, run: Path, cfg: dict[str, Any], samples: list[Path]) -> dict[str, Any]:
        """The sample metrics of `samples` against the run's training images (memorization
        against their VAE copies where the run listed them, as training measured). `check`
        (the web app's roots) sees the run's config first: measuring reads the model files,
        the training images and the metric models it names, and writes its cache."""
        if self.check is not None:
            self.check(run, cfg)
        from difftune import families
        from difftune.config import parse_config
        from difftune.config.metrics import MetricsConfig
        from difftune.report.metric_worker import training_images
        from difftune.report.sample_metrics import measure, read_sample, reference
        from difftune.report.scoring import Scorers
        from difftune.report.vae_copies import read_index
        from difftune.train.setup import load_data

        m = cfg.get("metrics", {})
        dino = self.dino or (Path(m["dino"]) if m.get("dino") else None)
        clip = self.clip or (Path(m["clip"]) if m.get("clip") else None)
        if dino is None:
            raise ConfigError(f"{run}: samples to measure but no DINOv2 folder; pass --dino "
                              "PATH (and --clip PATH for the CLIP score)")
        # Only its datasets are needed here: what the metrics and keep_best need is not.
        bare = {**cfg, "metrics": {}, "save": {**cfg.get("save", {}), "keep_best": None}}
        run_cfg = parse_config(bare, run, str(run / "config.resolved.json"))
        data = load_data(run_cfg, families.get(run_cfg.model.family, run_cfg.model.variant))
        scorers = Scorers.load(MetricsConfig(enabled=True, dino=dino, clip=clip))
        assert run_cfg.cache.dir is not None
        training = training_images(data.items)
        ref = reference(scorers, training, run_cfg.cache.dir, m.get("copy_similarity"),
                        read_index(run, training))
        return measure(scorers, ref, [read_sample(p) for p in samples])


def _default_by(cfg: dict[str, Any], entries: list[Entry]) -> str:
    kept = cfg.get("save", {}).get("keep_best")
    if kept:
        return kept
    return "fidelity" if any("fidelity" in e.figures for e in entries) else "val_loss"


def rank(runs: list[Path], by: str | None = None, dino: Path | None = None,
         clip: Path | None = None, check: Callable[[Path, dict[str, Any]], None] | None = None
         ) -> tuple[str, list[Entry]]:
    """Every checkpoint of `runs`, measured where needed (`check`: see `Measurer`), best
    first (unmeasured last); returns the measure used and the entries."""
    entries, configs, measurer = [], {}, Measurer(dino, clip, check)
    for run in runs:
        cfg, rows = _config(run), read_rows(run)
        configs[run] = cfg
        for step, files in sorted(checkpoints(run, cfg, rows).items()):
            e = Entry(str(run), step, str(files[0]), [str(f) for f in files],
                      _figures(rows, step),
                      samples=[str(p) for p in _samples(run, step)],
                      copying=_copying(rows, step), closest=_event_closest(rows, step))
            if e.samples and not SAMPLE_METRICS & set(e.figures):
                m = measurer.measure(run, cfg, [Path(p) for p in e.samples])
                e.figures.update({k: float(m[k]) for k in FIGURES if isinstance(m.get(k), float)})
                e.measured_now, e.copying = True, bool(m["copying"])
                e.closest = _closest(m.get("samples"))
            entries.append(e)
    text = by or _default_by(configs[runs[0]], entries)
    try:
        measure = Measure(text)
    except ValueError as err:
        raise ConfigError(f"--by {text!r}: {err}") from None
    for e in entries:
        if measure.names <= set(e.figures):
            e.score = measure.value(e.figures)
    sign = -1.0 if measure.higher else 1.0
    entries.sort(key=lambda e: (e.score is None, sign * (e.score or 0.0), e.run, e.step))
    return text, entries


def as_json(by: str, entries: list[Entry]) -> str:
    """The ranking as JSON: the measure and the entries, best first."""
    return json.dumps({"by": by, "checkpoints": [asdict(e) for e in entries]}, indent=1)


def table(by: str, entries: list[Entry]) -> list[str]:
    """The ranking as aligned text lines."""
    head = ["#", "run", "step", by, *FIGURES, "copying", "file"]
    lines = [head]
    for i, e in enumerate(entries, 1):
        fig = [f"{e.figures[k]:.4f}" if k in e.figures else "-" for k in FIGURES]
        lines.append([str(i) if e.score is not None else "-", e.run, str(e.step),
                      f"{e.score:.4f}" if e.score is not None else "unmeasured", *fig,
                      {True: "yes", False: "no", None: "-"}[e.copying], file_names(e)])
    widths = [max(len(row[c]) for row in lines) for c in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]


def file_names(e: Entry) -> str:
    """The names of a checkpoint's LoRA files, joined (`a_high_noise.safetensors +
    a_low_noise.safetensors` for a two-expert model's pair)."""
    return " + ".join(Path(f).name for f in e.files or [e.file])
