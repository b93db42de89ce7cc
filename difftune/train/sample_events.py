"""Sample events during training, and how a stop request ends one early.

A stop request (SIGINT/SIGTERM) during an event ends it after the current image, as one during
training ends the run after the current step. Only rank 0 samples; in a multi-process run the
request may reach another process (a scheduler preempting one of them), so rank 0 asks every
process before each image, in one all-reduce, whether any was asked to stop, while the others
wait in that same exchange until rank 0 says the event is over. A process blocked in the
exchange runs its signal handler once it returns, so a request that reaches another process
mid-image ends the event after at most one image more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from difftune.train.ema import using

if TYPE_CHECKING:
    from difftune.train.dist import Dist
    from difftune.train.loop import Hooks
    from difftune.train.setup import Run
    from difftune.train.state import TrainState


class SharedStop:
    """One event's stop predicate shared by every process: rank 0 `poll`s before each image
    and `release`s the others at the end; every other rank `wait`s."""

    def __init__(self, dist: "Dist", asked: Callable[[], bool]) -> None:
        self.dist, self.asked, self.stopped = dist, asked, False

    def poll(self) -> bool:
        """Rank 0, before an image: whether any process was asked to stop (then the event
        ends here, and the others know it from the same exchange)."""
        self.stopped, _ = self.dist.any_of([self.asked(), True])
        return self.stopped

    def release(self) -> None:
        """Rank 0, once the event is over (also after a failure): lets the others go on."""
        if not self.stopped:
            self.dist.any_of([self.asked(), False])

    def wait(self) -> None:
        """Every other rank: answer rank 0's polls until its event ends or stops."""
        while True:
            stop, more = self.dist.any_of([self.asked(), False])
            if stop or not more:
                return


def sample_event(run: "Run", hooks: "Hooks", state: "TrainState", step: int,
                 every_process: bool = True) -> None:
    """A sample event at `step` from the weights to use. `every_process`: called by every
    process at once (the exchange above); False where the others have gone on (the event
    after the last step), which stops on this process's own requests only."""
    sampler, dist = hooks.sampler, run.dist
    shared = SharedStop(dist, hooks.stop)
    if sampler is None:  # every process but rank 0, or a run without prompts
        if every_process and dist.world > 1 and run.cfg.sample.prompts is not None:
            shared.wait()
        return
    together = every_process and dist.world > 1
    # This step's LoRA, to keep: saved by rank 0 alone, never a collective (sampling during a
    # sharded run is refused at the start: memory/savers.py).
    if hooks.best is not None and hooks.best.reads_samples:
        with state.eval_weights(), using(state.ema, "saves"):
            hooks.best.candidate(step, hooks.checkpoints.save_lora)
    sampler.stop = shared.poll if together else hooks.stop
    try:
        with state.eval_weights(), using(state.ema, "samples"):
            written = sampler.run(step)
        if hooks.metrics is not None:  # measured in its own thread; training goes on
            hooks.metrics.submit(step, written)
    finally:
        if together:
            shared.release()
