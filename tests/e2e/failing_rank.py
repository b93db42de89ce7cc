"""`difftune` whose rank 1 fails at step 2 (a data error): run under accelerate launch by
test_distributed.py to show that one failing process stops the run, with its message."""

from __future__ import annotations

import os
import sys

from difftune.cli import main
from difftune.errors import DataError
from difftune.train import loop

real = loop._share_loss


def failing(run, batch, generator, done):  # type: ignore[no-untyped-def]
    """Rank 1 raises at its second step; every other call is the real one."""
    if os.environ.get("RANK") == "1" and done == 1:
        raise DataError("rank one could not read its batch (injected by the test)")
    return real(run, batch, generator, done)


loop._share_loss = failing
raise SystemExit(main(sys.argv[1:]))
