"""The sample-metrics child process: loads the metric models and measures sample events.

It runs apart from training (report/metric_worker.py starts it through multiprocessing's
"forkserver" where there is one, else "spawn": never a fork of the training process, which
holds CUDA and threads; the fork server is a fresh interpreter that only imports this module
and the transformers modules it needs (report/metric_preload.py), so a second metrics process
in one session, as in the tests, starts without importing torch again) so that its torch ops
do not take the training step's intra-op threads: it uses `threads` of them and measures at a
lower priority. Everything it says goes back over `results` as tuples:
("log", record) for its log records (the training process writes them to the run log),
("ready", began, ended, threads) once the models and the training images' features are
loaded (when it started and when it was ready, and the torch threads it measures with: what
`metrics.threads` asked, read back from torch), ("off", reason) when
they cannot load (it then exits), and ("done", step, figures, began, ended) or
("failed", step, reason) for each event, `began`/`ended` being its perf_counter times (one
monotonic clock for the whole machine on Linux, so the parent can compare them with its own).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from difftune.config.metrics import MetricsConfig
from difftune.report.sample_metrics import floors_line, measure, read_sample, reference
from difftune.report.scoring import Scorers

log = logging.getLogger("difftune")


class _Forward(logging.handlers.QueueHandler):
    """Sends this process's difftune log records to the parent as ("log", record)."""

    def enqueue(self, record: logging.LogRecord) -> None:
        self.queue.put(("log", record))


def _settle(results: Any, threads: int) -> None:
    """Log to the parent; leave Ctrl-C to the parent (it stops training and then closes
    this process after the queued events); take few threads."""
    import torch

    log.handlers[:] = [_Forward(results)]
    log.setLevel(logging.DEBUG)
    log.propagate = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def _lower_priority() -> None:
    """Measure at a lower priority, so the training process keeps the cores it needs. Done
    once the models are loaded: the start-up (imports, loading) is a one-off of a few seconds
    that, niced on a busy machine, would take minutes and hold up a short run's end."""
    if hasattr(os, "nice"):
        try:
            os.nice(10)
        except OSError:
            pass


def serve(cfg: MetricsConfig, training: list[Path], cache_dir: Path, threads: int,
          jobs: Any, results: Any, copies: list[Path] | None = None) -> None:
    """The child's main: measure each (step, paths) from `jobs` until None arrives (against
    the training images' VAE `copies` where given; report/vae_copies.py)."""
    started = time.perf_counter()
    _settle(results, threads)
    try:
        scorers = Scorers.load(cfg)
        ref = reference(scorers, training, cache_dir, cfg.copy_similarity, copies)
    except Exception as err:  # models that cannot load: the parent turns metrics off
        log.debug("metrics failed:\n%s", traceback.format_exc())
        results.put(("off", f"{type(err).__name__}: {err}"))
        return
    threads = torch.get_num_threads()  # read back, so a run log shows what it really got
    log.info("metrics: %d training images, %s; %d torch threads", len(training),
             floors_line(ref), threads)
    results.put(("ready", started, time.perf_counter(), threads))
    _lower_priority()
    while (job := jobs.get()) is not None:
        step, paths = job
        began = time.perf_counter()
        try:
            figures = measure(scorers, ref, [read_sample(p) for p in paths if p.is_file()])
        except Exception as err:  # one event's failure skips that event
            log.debug("metrics at step %d failed:\n%s", step, traceback.format_exc())
            results.put(("failed", step, f"{type(err).__name__}: {err}"))
            continue
        results.put(("done", step, figures, began, time.perf_counter()))
