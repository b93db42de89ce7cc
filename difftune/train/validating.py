"""The validation hook of the training loop: evaluate when due, keep the best, stop early.

In a multi-process run every process takes the same decisions: the loss they act on is rank
0's (sent to all), and a failure on any process (its evaluation, or rank 0's save of the best
file) turns validation off on every process, as it does in one process, instead of one process
leaving the others waiting in a collective. In a sharded (FSDP) run a failure is raised: a
process that fails inside FSDP's collectives cannot tell the others, and the run stops (every
process, through the launcher).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from difftune.train.ema import using
from difftune.train.setup import Run, set_training
from difftune.train.validation import Evaluation, Validator

if TYPE_CHECKING:
    from difftune.train.loop import Hooks
    from difftune.train.state import TrainState

log = logging.getLogger("difftune")


def validate(run: Run, hooks: "Hooks", state: "TrainState", step: int,
             extra: dict[str, Any]) -> bool:
    """When due: the validation loss of the weights the run saves (in eval mode) into
    `extra` (this step's metrics row), `<name>-best` written when it improved (keep_best);
    returns whether early stopping ends the run after this step."""
    v = hooks.validator
    if v is None or not v.due(step):
        return False
    set_training(run, False)
    try:
        with state.eval_weights(), using(state.ema, "saves"):
            ev = _shared(run, _evaluated(run, v))
            failure = _act(run, hooks, state, v, step, ev) if isinstance(ev, Evaluation) else ev
    finally:
        set_training(run, True)
    if run.dist.any(failure is not None):  # one decision for every process
        log.warning("validation failed and is now off (training goes on): %s",
                    failure or "on another process of this run")
        hooks.validator = None
        return False
    assert isinstance(ev, Evaluation)
    extra.update(ev.row())
    hooks.reporter.timestep_chart(step, ev.by_t)
    if not v.should_stop(state.validation):
        return False
    log.info("early stop after step %d: no validation improvement in %d evaluations (best "
             "%s at step %s)", step, state.validation["bad"], state.validation.get("best"),
             state.validation.get("best_step"))
    return True


def _evaluated(run: Run, v: Validator) -> Evaluation | str:
    """This process's evaluation, or what failed (raised in a sharded run)."""
    try:
        return v.evaluate()
    except Exception as err:  # a measurement never stops the run it measures
        if run.sharded:
            raise
        return _failed(run, err)


def _shared(run: Run, mine: Evaluation | str) -> Evaluation | str:
    """Rank 0's evaluation on every process, or the first failure of any process (one
    exchange every process joins)."""
    every = run.dist.gather(mine)
    return next((m for m in every if isinstance(m, str)), every[0])


def _act(run: Run, hooks: "Hooks", state: "TrainState", v: Validator, step: int,
         ev: Evaluation) -> str | None:
    """Judge `ev` and write the best files (validation.keep_best, save.keep_best's candidate);
    what failed here, or None (raised in a sharded run, whose saves are collective)."""
    try:
        if v.judge(state.validation, step, ev.loss) and run.cfg.validation.keep_best:
            hooks.checkpoints.save_lora(step, path=v.best_path(run.out))
        if hooks.best is not None and hooks.best.reads_val:
            hooks.best.candidate(step, hooks.checkpoints.save_lora)
            hooks.best.record(step, {"val_loss": ev.loss})
    except Exception as err:
        if run.sharded:
            raise
        return _failed(run, err)
    return None


def _failed(run: Run, err: Exception) -> str:
    """`err` as one line naming the process (several processes)."""
    where = f" (rank {run.dist.rank})" if run.dist.world > 1 else ""
    return f"{type(err).__name__}: {err}{where}"
