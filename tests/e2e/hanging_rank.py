"""`difftune` whose rank 1 hangs at its third step (a node that stops answering), after writing
the file `$DIFFTUNE_TEST_HUNG_FILE`: run by test_multinode.py as the program of two torchrun
node groups; the test then kills node 1 (its agent and its process) as a lost machine."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from difftune.cli import main
from difftune.train import loop

real = loop._share_loss


def hanging(run, batch, generator, done):  # type: ignore[no-untyped-def]
    """Rank 1 stops answering at its third step; every other call is the real one."""
    if os.environ.get("RANK") == "1" and done == 2:
        Path(os.environ["DIFFTUNE_TEST_HUNG_FILE"]).write_text(str(os.getpid()))
        time.sleep(3600)
    return real(run, batch, generator, done)


loop._share_loss = hanging
raise SystemExit(main(sys.argv[1:]))
