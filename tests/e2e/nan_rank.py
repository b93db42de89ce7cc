"""`difftune` whose rank 1 alone gets a NaN loss at step 2: run under accelerate launch by
test_fsdp.py to show that a sharded run skips that step on every process (rather than hanging
in FSDP's collectives because one process left out its backward)."""

from __future__ import annotations

import os
import sys

from difftune.cli import main
from difftune.train import loop

real = loop._share_loss


def poisoned(run, batch, generator, done):  # type: ignore[no-untyped-def]
    """Rank 1's loss is NaN at its second step; every other call is the real one."""
    loss = real(run, batch, generator, done)
    if os.environ.get("RANK") == "1" and done == 1 and loss is not None:
        return loss * float("nan")
    return loss


loop._share_loss = poisoned
raise SystemExit(main(sys.argv[1:]))
