"""Sample metrics off the training step's path: a child process measures each event.

A sample event hands its PNG files to `submit` and training goes on. The measuring runs in a
child process (report/metric_process.py), started at the first event (a run that never samples
pays nothing), with one torch thread (`metrics.threads`) at a lower priority, so its work does
not take the training step's threads as a thread of this process did. A thread here feeds it
one event at a time and hands each event's figures to `on_result` in this process
(metrics.jsonl, TensorBoard, the best-checkpoint rule).

When events come faster than they are measured, at most `backlog` wait: a newer event pushes
out the oldest waiting one, which is skipped (logged). The newest event, and so the run's
last, is always measured. Any failure, the child's death included, is logged and that event
(or, when the models cannot load or the child died, the metrics) skipped: a measurement never
stops the run it measures. `on_skip` is told of every event whose figures will never come
(skipped, failed, nothing sampled, metrics off) as soon as that is known, so keep_best deletes
that step's candidate then, not at the run's end: it only ever compares measured steps.
`close` waits for the events still queued, so the last one is written too, and logs how long
the end of the run waited when that was long.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from difftune.config.metrics import MetricsConfig
from difftune.report import metric_process
from difftune.report.sample_metrics import copy_warning, floors_line, reference
from difftune.report.scoring import Scorers

log = logging.getLogger("difftune")

Result = Callable[[int, dict[str, Any]], None]
BACKLOG = 2  # events waiting to be measured, beside the one being measured
LONG_WAIT = 2.0  # seconds: a longer wait for the last events at close is logged
POLL = 0.5  # seconds between checks that the child still lives while an event is measured


class MetricWorker:
    """Measures sample events in a child process, one at a time, oldest first, at most
    `backlog` waiting."""

    def __init__(self, cfg: MetricsConfig, training: list[Path], cache_dir: Path,
                 on_result: Result, on_skip: Callable[[int], None] | None = None,
                 backlog: int = BACKLOG, copies: list[Path] | None = None) -> None:
        """`copies`: each training image's VAE copy (report/vae_copies.py), what a sample's
        likeness to a copy is measured on (None: the training images themselves)."""
        self.cfg, self.training, self.cache_dir = cfg, training, cache_dir
        self.copies = copies
        self.on_result, self.on_skip, self.backlog = on_result, on_skip, backlog
        # When the child started up and when it measured (perf_counter times; benches).
        self.startup: tuple[float, float] | None = None
        self.threads: int | None = None  # the child's torch threads, as it reported them
        self.busy: list[tuple[float, float]] = []
        self._pending: deque[tuple[int, list[Path]]] = deque()
        self._cond = threading.Condition()
        self._closing = self._broken = False
        self._thread: threading.Thread | None = None
        self._proc: Any = None
        self._jobs: Any = None
        self._results: Any = None

    def submit(self, step: int, samples: list[Path]) -> None:
        """Queue an event's samples (returns at once; nothing to measure, or metrics off:
        nothing queued, the event skipped); the oldest waiting event is skipped when more
        than `backlog` would wait."""
        with self._cond:
            lost = not samples or self._broken or self._closing
            if not lost:
                self._pending.append((step, list(samples)))
                behind = [self._pending.popleft()[0]
                          for _ in range(len(self._pending) - self.backlog)]
                if self._thread is None:
                    self._start()
                self._cond.notify()
        if lost:
            self._skip(step)
            return
        for old in behind:
            log.warning("sample metrics at step %d skipped: measuring is behind (%d newer "
                        "events wait; the newest is always measured)", old, self.backlog)
            self._skip(old)

    def _skip(self, step: int) -> None:
        """Tell `on_skip` that `step`'s figures will never come (its failure is logged: a
        measurement never stops the run)."""
        if self.on_skip is None:
            return
        try:
            self.on_skip(step)
        except Exception as err:
            log.warning("sample metrics: dropping step %d failed: %s: %s", step,
                        type(err).__name__, err)

    def close(self) -> None:
        """Measure what is queued, then stop the child process and the feeding thread."""
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            waiting = len(self._pending)
            self._cond.notify()
        started = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - started
        if waited > LONG_WAIT:
            log.info("sample metrics: the end of the run waited %.1f s for the event being "
                     "measured and %d queued", waited, waiting)
        self._stop_child()

    def _start(self) -> None:
        """Start the child process and the thread feeding it."""
        ctx = _context()
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=metric_process.serve, name="difftune-metrics",
                                 args=(self.cfg, self.training, self.cache_dir,
                                       self.cfg.threads, self._jobs, self._results,
                                       self.copies),
                                 daemon=True)
        self._proc.start()
        self._thread = threading.Thread(target=self._serve, name="difftune-metrics",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Send the child one event at a time until closed and drained, or the child fails."""
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._pending.popleft()
            self._jobs.put(job)
            if not self._await(job[0]):
                with self._cond:
                    self._broken = True
                    lost = [job[0], *(step for step, _ in self._pending)]
                    self._pending.clear()
                for step in lost:
                    self._skip(step)
                return

    def _await(self, step: int) -> bool:
        """Pass on what the child says until `step`'s figures (or failure) arrive; False when
        the child cannot measure any more (models that cannot load, or it died)."""
        while True:
            try:
                msg = self._results.get(timeout=POLL)
            except queue.Empty:
                if self._proc.is_alive():
                    continue
                log.warning("sample metrics are off (training goes on): the metrics process "
                            "died (exit code %s) while measuring step %d",
                            self._proc.exitcode, step)
                return False
            kind = msg[0]
            if kind == "log":
                log.handle(msg[1])
            elif kind == "ready":
                self.startup, self.threads = msg[1:3], msg[3]
            elif kind == "off":
                log.warning("sample metrics are off (training goes on): %s", msg[1])
                return False
            elif kind == "failed":
                log.warning("sample metrics at step %d failed and were skipped (training "
                            "goes on): %s", msg[1], msg[2])
                self._skip(msg[1])
                return True
            elif kind == "done":
                self._deliver(*msg[1:])
                return True

    def _deliver(self, step: int, figures: dict[str, Any], began: float, ended: float) -> None:
        """Hand one event's figures to `on_result` (a failure there skips the event)."""
        self.busy.append((began, ended))
        try:
            warning = copy_warning(step, figures)
            if warning:
                log.warning("%s", warning)
            self.on_result(step, figures)
        except Exception as err:
            log.warning("sample metrics at step %d failed and were skipped (training goes "
                        "on): %s: %s", step, type(err).__name__, err)
            self._skip(step)

    def _stop_child(self) -> None:
        """Ask the child to exit (it has nothing queued now); end it if it does not."""
        if self._proc.is_alive():
            self._jobs.put(None)
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join()
        for q in (self._jobs, self._results):
            q.cancel_join_thread()
            q.close()


def _context() -> Any:
    """Forked from a fork server that imported only the metrics code (report/metric_preload.py:
    no CUDA, no threads; see report/metric_process.py), or spawned where there is no fork server (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["difftune.report.metric_preload"])
    return ctx


def training_images(items: list[Any]) -> list[Path]:
    """The distinct ordinary training images of a run's items (no regularization images)."""
    return list(dict.fromkeys(it.path for it in items if not it.regularization))


def describe(cfg: MetricsConfig, training: list[Path], cache_dir: Path,
             copies: list[Path] | None = None) -> list[str]:
    """`check`'s line: the metric models loaded (a model that cannot load is a
    ModelFileError now, not a warning mid-run) and the training images' features computed
    (and cached), with the copy floors they give (of their VAE `copies`, as training
    measures) and the time it took."""
    if not cfg.enabled:
        return ["metrics: off"]
    started = time.perf_counter()
    scorers = Scorers.load(cfg)
    ref = reference(scorers, training, cache_dir, cfg.copy_similarity, copies)
    clip = f"CLIP {cfg.clip}" if cfg.clip is not None else "no CLIP score (metrics.clip unset)"
    return [f"metrics: on: DINOv2 {cfg.dino}, {clip}; {len(training)} training images, "
            f"{floors_line(ref)}; models and features ready in "
            f"{time.perf_counter() - started:.2f} s"]
