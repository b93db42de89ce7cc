"""What resuming a run from an earlier checkpoint replaces, said before it is done.

`difftune train --resume CHECKPOINT` continues the run from that checkpoint's step in the same
folder: the loss rows logged after that step are dropped from metrics.jsonl, and as the run
trains again it writes its checkpoints, step LoRA files, samples and final files under the
same names as the first time, replacing them. The run page lists these (from the files it
already shows) in the confirmation it asks before resuming from a checkpoint that is not the
last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from difftune.ui import run_outputs as outputs
from difftune.ui import runs
from difftune.ui.security import Roots

SHOWN = 8  # names listed in full; the rest counted


@dataclass
class Replaced:
    """The run's outputs after `step` that a resume from `step` replaces or drops."""

    step: int
    checkpoints: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)  # LoRA, embedding and model files
    samples: int = 0
    sample_steps: int = 0
    metric_rows: int = 0

    @property
    def nothing(self) -> bool:
        """Whether the run wrote nothing after `step`."""
        return not (self.checkpoints or self.weights or self.samples or self.metric_rows)

    def lines(self) -> list[str]:
        """What is replaced, one kind a line, as the confirmation shows it."""
        out = []
        if self.checkpoints:
            out.append(f"{len(self.checkpoints)} later checkpoint(s): {_names(self.checkpoints)}")
        if self.weights:
            out.append(f"{len(self.weights)} later LoRA/model file(s): {_names(self.weights)}")
        if self.samples:
            out.append(f"{self.samples} sample image(s) of {self.sample_steps} later step(s)")
        if self.metric_rows:
            out.append(f"the {self.metric_rows} loss row(s) logged after step {self.step} "
                       "(dropped from the chart)")
        return out


def _names(names: list[str]) -> str:
    """The first names, then how many more."""
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def replaced_by_resume(run_dir: Path, step: int, roots: Roots | None = None) -> Replaced:
    """What resuming the run in `run_dir` from its checkpoint at `step` replaces: the
    checkpoints, step files and samples of later steps, the final files (written again at
    the end), and the loss rows after `step`."""
    out = Replaced(step)
    for item in outputs.files(run_dir, roots):
        later = item.step is not None and item.step > step
        name = Path(item.path).name
        if item.kind == "checkpoint" and later:
            out.checkpoints.append(name)
        elif item.kind != "checkpoint" and (later or item.final):
            out.weights.append(name)
    images = [s for s in outputs.samples(run_dir, roots) if s.step is not None and s.step > step]
    out.samples, out.sample_steps = len(images), len({s.step for s in images})
    out.metric_rows = len(runs.metrics(run_dir, step, roots))
    return out
