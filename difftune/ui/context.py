"""What every page and API module of the app shares: the roots, the job queue, the settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from difftune.ui.security import Roots

if TYPE_CHECKING:
    from difftune.ui.jobs.queue import JobQueue


@dataclass
class UiContext:
    """The app's shared state. `queue` is the only live object; everything else is read from
    disk on each request."""

    roots: Roots
    queue: "JobQueue"
    token: str | None = None
    origin_token: str | None = None  # lets a request from another web site through
    lock: IO[str] | None = None  # the open lock file that makes this app the queue's only one

    @property
    def state_dir(self) -> Path:
        """Where the job database lives (`<first root>/.difftune-ui`)."""
        return self.roots.app_folder

    @property
    def runs_dir(self) -> Path:
        """Where runs made in the app go by default (`<first root>/runs`)."""
        return self.roots.main / "runs"
