"""`difftune` whose processes measure different validation losses: rank 0's improve at every
evaluation, rank 1's get worse (as two devices whose kernels round apart may disagree). Run
under accelerate launch by test_distributed.py to show that every process takes rank 0's
early-stopping decision, rather than rank 1 stopping alone while rank 0 waits for it in the
next step's all-reduce."""

from __future__ import annotations

import os
import sys

from difftune.cli import main
from difftune.train.validation import Evaluation, Validator

real = Validator.evaluate
calls = [0]


def drifting(self: Validator) -> Evaluation:
    """The real evaluation, its loss replaced: 10 - n on rank 0, n on rank 1 (n-th call)."""
    ev = real(self)
    calls[0] += 1
    ev.loss = float(calls[0]) if os.environ.get("RANK") == "1" else 10.0 - calls[0]
    return ev


Validator.evaluate = drifting  # type: ignore[method-assign]
raise SystemExit(main(sys.argv[1:]))
