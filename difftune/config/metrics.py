"""The `[metrics]` section: sample-quality metrics measured at every sample event.

Off by default. Each metric's model is a local folder (nothing is downloaded): `dino` (a
DINOv2 folder, read by transformers' AutoModel) gives subject fidelity, memorization and
diversity; `clip` (a full CLIP folder: text and vision towers) gives the CLIP score. A family's
own CLIP text encoder has no vision tower, so it cannot score an image against its prompt:
without `clip` the CLIP score is left out (a warning says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

from pydantic import Field, model_validator

from difftune.config.base import Section


class MetricsConfig(Section):
    """Which sample metrics run after each sample event, and the models they read."""

    enabled: bool = Field(False, description="Measure the samples of every sample event "
                          "(in a child process: training never waits for it).")
    dino: Path | None = Field(
        None, description="A local DINOv2 folder (config.json, weights, "
        "preprocessor_config.json): subject fidelity, memorization and diversity.")
    clip: Path | None = Field(
        None, description="A local CLIP folder (CLIPModel with its processor and tokenizer): "
        "the CLIP score of each sample against its prompt (unset: no CLIP score).")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the metric models run (cpu leaves the accelerator to "
        "training).")
    threads: int = Field(
        1, ge=1, le=64, description="Torch threads of the metrics process (it runs at a "
        "lower priority; more threads measure faster but take cores from a CPU run's steps).")
    copy_similarity: float | None = Field(
        None, gt=0, le=1, description="Unset (the default): a sample is reported as a copy "
        "when it is as similar to a training image as that image's own degraded copies (JPEG, "
        "noise, half-size resampling) are, measured per image with metrics.dino. Set: a "
        "sample this similar to any training image is reported as a copy instead.")

    @model_validator(mode="after")
    def _needs_dino(self) -> "MetricsConfig":
        if self.enabled and self.dino is None:
            raise ValueError("metrics.enabled needs metrics.dino, a local DINOv2 folder (e.g. "
                             "a download of facebook/dinov2-small); set it or set "
                             "metrics.enabled = false")
        return self


def metrics_problems(m: MetricsConfig, cuda: Callable[[], bool]) -> list[str]:
    """The metric model folders that cannot work (after paths were resolved), and a CUDA
    device asked for where `cuda()` says there is none."""
    if not m.enabled:
        return []
    problems = []
    for name in ("dino", "clip"):
        folder = getattr(m, name)
        if folder is not None and not (folder / "config.json").is_file():
            problems.append(f"metrics.{name}: {folder} is not a model folder (no config.json); "
                            f"point it at a local {'DINOv2' if name == 'dino' else 'CLIP'} "
                            "folder saved by transformers")
    if m.device == "cuda" and not cuda():
        problems.append("metrics.device = \"cuda\" but this machine has no CUDA device; set "
                        "metrics.device = \"cpu\"")
    return problems


def metrics_warnings(m: MetricsConfig, sampling: bool) -> list[str]:
    """What `[metrics]` will not measure with the rest of the config."""
    if not m.enabled:
        return []
    lines = [] if m.clip is not None else [
        "metrics.clip is unset: no CLIP score (a family's text encoder has no vision tower to "
        "score images with; point metrics.clip at a local CLIP folder)"]
    if not sampling:
        lines.append("metrics.enabled is ignored: nothing is sampled (set sample.prompts)")
    return lines
