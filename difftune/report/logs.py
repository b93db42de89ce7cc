"""Logging: short messages on the console, everything (with tracebacks) in the run's log file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER = "difftune"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time of the record (it may be replaced)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_console(verbose: bool = False) -> None:
    """Console handler for the difftune logger: INFO (or DEBUG) and up, message only."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.DEBUG)
    if any(getattr(h, "_difftune_console", False) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    handler._difftune_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    # Library chatter (e.g. transformers' optional-backend notices) stays out of the console.
    quiet_libraries()


def quiet_rank(rank: int) -> None:
    """In a multi-process run, rank 0 speaks for the run; every other process shows only its
    errors on the console, marked with its rank."""
    for h in logging.getLogger(LOGGER).handlers:
        if getattr(h, "_difftune_console", False):
            h.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s: %(message)s"))
            if rank:
                h.setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Library chatter stays off the console: optional-backend notices of transformers and
    diffusers, torchao's note that its CUDA kernels do not load on a CPU-only build, and
    torch's deprecation notes that torchao's import triggers."""
    for noisy in ("transformers", "diffusers", "peft", "accelerate", "torchao",
                  "torch.utils._pytree", "optimum.quanto"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


class _RunLogHandler(logging.FileHandler):
    """The run log; when it cannot be written (a full disk), one line says so and the log is
    off, instead of a traceback on the console for every message."""

    def handleError(self, record: logging.LogRecord) -> None:
        logging.getLogger(LOGGER).removeHandler(self)
        print(f"warning: the run log {self.baseFilename} cannot be written any more "
              f"({sys.exc_info()[1]}); training goes on without it", file=sys.stderr)


def attach_run_log(path: Path) -> Path:
    """Append every difftune record, DEBUG and up, to the run's log file (one run log at a time)."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.DEBUG)
    target = str(path.resolve())
    for h in list(logger.handlers):
        if isinstance(h, logging.FileHandler):
            if h.baseFilename == target:
                return path
            logger.removeHandler(h)
            h.close()
    handler = _RunLogHandler(target, encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    return path


def current_run_log() -> Path | None:
    """The most recently attached run log, if any."""
    for h in reversed(logging.getLogger(LOGGER).handlers):
        if isinstance(h, logging.FileHandler):
            return Path(h.baseFilename)
    return None
