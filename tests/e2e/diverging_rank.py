"""`difftune` whose processes measure different validation losses: rank 0's improve at every
evaluation, rank 1's get worse (as two devices whose kernels round apart may disagree), and
rank 1's third evaluation fails. Run under accelerate launch by test_distributed_decisions.py
to show that every process takes rank 0's early-stopping decision and turns validation off
when one process's evaluation failed, rather than one process stopping or failing alone while
the other waits for it in a collective."""

from __future__ import annotations

import os
import sys

from difftune.cli import main
from difftune.train.validation import Evaluation, Validator

real = Validator.evaluate
calls = [0]


def drifting(self: Validator) -> Evaluation:
    """The real evaluation, its loss replaced: 10 - n on rank 0, n on rank 1 (n-th call);
    rank 1's third fails."""
    ev = real(self)
    calls[0] += 1
    if os.environ.get("RANK") == "1" and calls[0] == 3:
        raise RuntimeError("rank one could not evaluate (injected by the test)")
    ev.loss = float(calls[0]) if os.environ.get("RANK") == "1" else 10.0 - calls[0]
    return ev


Validator.evaluate = drifting  # type: ignore[method-assign]
raise SystemExit(main(sys.argv[1:]))
