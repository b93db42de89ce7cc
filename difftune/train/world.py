"""Whether this process is one of several that a launcher started, read from the environment
alone: the CLI asks before anything imports torch, so a config mistake is reported in well
under a second (`train/dist.py` holds the process group itself)."""

from __future__ import annotations

import os


def launched() -> bool:
    """Whether this process was started by accelerate launch / torchrun with several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
