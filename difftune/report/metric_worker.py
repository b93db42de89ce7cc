"""Sample metrics off the training step's path: one background thread measures each event.

A sample event hands its PNG files to `submit` and training goes on; the thread loads the
metric models and the training images' features when its first job arrives (not while the
run starts), measures, and hands the figures to `on_result` (metrics.jsonl, TensorBoard, the
best-checkpoint rule). Any failure is logged and that event skipped: a measurement never stops
the run it measures. `close` waits for the queued events, so the last one is written too.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from difftune.config.metrics import MetricsConfig
from difftune.report.sample_metrics import (Reference, copy_warning, floors_line, measure,
                                            read_sample, reference)
from difftune.report.scoring import Scorers

log = logging.getLogger("difftune")

Result = Callable[[int, dict[str, Any]], None]


class MetricWorker:
    """Measures sample events in a daemon thread, one at a time, in the order submitted."""

    def __init__(self, cfg: MetricsConfig, training: list[Path], cache_dir: Path,
                 on_result: Result) -> None:
        self.cfg, self.training, self.cache_dir = cfg, training, cache_dir
        self.on_result = on_result
        self._jobs: queue.Queue[tuple[int, list[Path]] | None] = queue.Queue()
        self._scorers: Scorers | None = None
        self._ref: Reference | None = None
        self._broken = False
        self._thread = threading.Thread(target=self._serve, name="difftune-metrics",
                                        daemon=True)
        self._thread.start()

    def submit(self, step: int, samples: list[Path]) -> None:
        """Queue an event's samples (returns at once; nothing to measure: nothing queued)."""
        if samples and not self._broken:
            self._jobs.put((step, list(samples)))

    def close(self) -> None:
        """Measure what is queued, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not self._broken:
                self._one(*job)

    def _ready(self) -> tuple[Scorers, Reference]:
        """The models and the training images' features, loaded on first use."""
        if self._scorers is None or self._ref is None:
            self._scorers = Scorers.load(self.cfg)
            self._ref = reference(self._scorers, self.training, self.cache_dir,
                                  self.cfg.copy_similarity)
            log.info("metrics: %d training images, %s", len(self.training),
                     floors_line(self._ref))
        return self._scorers, self._ref

    def _one(self, step: int, paths: list[Path]) -> None:
        try:
            scorers, ref = self._ready()
        except Exception as err:  # models that cannot load: metrics off, training goes on
            self._broken = True
            log.debug("metrics failed:\n%s", traceback.format_exc())
            log.warning("sample metrics are off (training goes on): %s: %s",
                        type(err).__name__, err)
            return
        try:
            found = [p for p in paths if p.is_file()]
            m = measure(scorers, ref, [read_sample(p) for p in found])
            warning = copy_warning(step, m)
            if warning:
                log.warning("%s", warning)
            self.on_result(step, m)
        except Exception as err:  # one event's failure skips that event
            log.debug("metrics at step %d failed:\n%s", step, traceback.format_exc())
            log.warning("sample metrics at step %d failed and were skipped (training goes "
                        "on): %s: %s", step, type(err).__name__, err)


def training_images(items: list[Any]) -> list[Path]:
    """The distinct ordinary training images of a run's items (no regularization images)."""
    return list(dict.fromkeys(it.path for it in items if not it.regularization))


def describe(cfg: MetricsConfig, training: list[Path], cache_dir: Path) -> list[str]:
    """`check`'s line: the metric models loaded (a model that cannot load is a
    ModelFileError now, not a warning mid-run) and the training images' features computed
    (and cached), with the copy floors they give and the time it took."""
    if not cfg.enabled:
        return ["metrics: off"]
    import time

    started = time.perf_counter()
    scorers = Scorers.load(cfg)
    ref = reference(scorers, training, cache_dir, cfg.copy_similarity)
    clip = f"CLIP {cfg.clip}" if cfg.clip is not None else "no CLIP score (metrics.clip unset)"
    return [f"metrics: on: DINOv2 {cfg.dino}, {clip}; {len(training)} training images, "
            f"{floors_line(ref)}; models and features ready in "
            f"{time.perf_counter() - started:.2f} s"]
