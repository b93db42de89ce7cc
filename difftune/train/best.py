"""`save.keep_best`: keep `<name>-best.safetensors`, the LoRA of the step that scores best.

A step's score needs every metric its expression names (config/keep_best.py). The validation
loss is known during the step; sample metrics arrive later from their own thread, when the
weights have moved on. So at each step where a named metric is measured, the LoRA of that step
is written as a candidate (`.best-candidates/step-N.safetensors`, in the training thread, from
the weights the run saves); when the step's figures are complete, the candidate becomes the
best file (an atomic rename) if it scores better, else it is deleted. `best.json` records
every score, the winner, and by how much it beat the last measured step and the runner-up.

In a multi-process run every process holds a keeper and writes each candidate with the others
(an FSDP save gathers the whole weights, a collective every process must join), while rank 0
alone judges: scores, keeps the best file and writes `best.json`. Whether a candidate is
written depends only on the calls made, never on files one process sees, so every process
takes the same decision.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from difftune.config.keep_best import SAMPLE_METRICS, Measure

log = logging.getLogger("difftune")

RECORD = "best.json"
CANDIDATES = ".best-candidates"


class BestKeeper:
    """Scores measured steps by the keep_best measure and keeps the best step's LoRA."""

    def __init__(self, measure: Measure, out: Path, name: str, resumed_at: int | None,
                 suffixes: tuple[str, ...] = ("",), judges: bool = True) -> None:
        """`suffixes` end the stems of the files one save writes (a two-expert model's
        `_high_noise` and `_low_noise`; one file: ""). `judges`: this process scores and
        keeps (rank 0); the others only join the candidates' saves."""
        self.measure, self.out = measure, out
        self.suffixes = suffixes
        self.file = out / f"{name}-best{suffixes[0]}.safetensors"
        self.candidates = out / CANDIDATES
        self.figures: dict[int, dict[str, float]] = {}
        self.scores: dict[int, float] = {}
        self.judges = judges
        self._written: set[int] = set()  # steps whose candidate was saved (every process)
        self._lock = threading.Lock()
        if judges:
            shutil.rmtree(self.candidates, ignore_errors=True)  # a killed run's leftovers
        if judges and resumed_at is not None:
            self._load(resumed_at)

    @property
    def reads_val(self) -> bool:
        """Whether the measure reads the validation loss."""
        return "val_loss" in self.measure.names

    @property
    def reads_samples(self) -> bool:
        """Whether the measure reads sample metrics."""
        return bool(self.measure.names & SAMPLE_METRICS)

    def best_step(self) -> int | None:
        """The step scoring best so far (None before the first complete score)."""
        if not self.scores:
            return None
        key = (lambda s: self.scores[s]) if self.measure.higher else (lambda s: -self.scores[s])
        return max(sorted(self.scores), key=key)

    def candidate(self, step: int, save: Callable[..., Path]) -> None:
        """Write the LoRA of `step` as a candidate, once a step (training thread; `save` is the
        checkpoint manager's save_lora, called with the weights the run saves in place; on
        every process at the same steps, which writes on rank 0 only)."""
        if step in self._written:
            return
        self._written.add(step)
        if self.judges:
            self.candidates.mkdir(parents=True, exist_ok=True)
        save(step, path=self.candidates / f"step-{step:06d}.safetensors")

    def record(self, step: int, figures: dict[str, Any]) -> None:
        """Add measured figures of `step` (any thread); once they are complete, score the step
        and keep its candidate if it is the best (rank 0; elsewhere nothing)."""
        if not self.judges:
            return
        with self._lock:
            have = self.figures.setdefault(step, {})
            have.update({k: float(v) for k, v in figures.items()
                         if k in self.measure.names and isinstance(v, (int, float))})
            if not self.measure.names <= set(have) or step in self.scores:
                return
            try:
                score = self.measure.value(have)
            except ZeroDivisionError:
                score = math.nan
            candidates = self._files(self.candidates / f"step-{step:06d}.safetensors")
            if not math.isfinite(score):
                log.warning("keep_best: %s is not finite at step %d; step skipped",
                            self.measure.text, step)
                self._drop(candidates)
                return
            previous = self.best_step()
            self.scores[step] = score
            if self.best_step() == step and all(c.is_file() for c in candidates):
                for candidate, best in zip(candidates, self._files(self.file)):
                    os.replace(candidate, best)
                log.info("keep_best: step %d is the best so far (%s = %.6g): %s", step,
                         self.measure.text, score, self.file.name)
            elif self.best_step() == step:  # no candidate: the scores say so, the file cannot
                self.scores.pop(step)
                log.warning("keep_best: no LoRA of step %d was kept to compare (step skipped)",
                            step)
            else:
                self._drop(candidates)
            if self.best_step() != previous:
                self._write()

    def skipped(self, step: int) -> None:
        """`step`'s sample metrics will never come (skipped, failed, nothing sampled,
        metrics off): drop its candidate now; an unmeasured step is never compared."""
        if not self.judges:
            return
        with self._lock:
            if step not in self.scores:
                self._drop(self._files(self.candidates / f"step-{step:06d}.safetensors"))

    def _files(self, path: Path) -> list[Path]:
        """The files a save at `path` writes, one per suffix (`path` itself for "")."""
        stem = path.name.removesuffix(".safetensors")
        base = stem.removesuffix(self.suffixes[0]) if self.suffixes[0] else stem
        return [path.with_name(f"{base}{s}.safetensors") for s in self.suffixes]

    @staticmethod
    def _drop(files: list[Path]) -> None:
        """Delete candidates that lost (or could not be scored)."""
        for file in files:
            file.unlink(missing_ok=True)

    def summary(self) -> dict[str, Any]:
        """Which step won, its score, and its margin over the last measured step and the
        runner-up (what best.json and the run's last log line say)."""
        best = self.best_step()
        out: dict[str, Any] = {"keep_best": self.measure.text,
                               "higher_is_better": self.measure.higher,
                               "scores": {str(k): v for k, v in sorted(self.scores.items())}}
        if best is None:
            return out
        sign = 1 if self.measure.higher else -1
        last = max(self.scores)
        others = [s for s in self.scores if s != best]
        runner = max(others, key=lambda s: sign * self.scores[s]) if others else None
        out.update(best_step=best, best=self.scores[best], file=self.file.name, last_step=last,
                   margin_over_last=sign * (self.scores[best] - self.scores[last]))
        if runner is not None:
            out.update(runner_up_step=runner,
                       margin_over_runner_up=sign * (self.scores[best] - self.scores[runner]))
        return out

    def finish(self) -> str | None:
        """Write best.json, drop the candidates left, and return the summary line (rank 0;
        elsewhere None)."""
        if not self.judges:
            return None
        shutil.rmtree(self.candidates, ignore_errors=True)
        self._write()
        s = self.summary()
        if "best_step" not in s:
            return None
        line = (f"best checkpoint by {s['keep_best']}: step {s['best_step']} "
                f"({s['best']:.6g}), {s['file']}")
        if s["last_step"] != s["best_step"]:
            line += (f"; {s['margin_over_last']:.4g} better than the last measured step "
                     f"({s['last_step']})")
        if "runner_up_step" in s:
            line += (f"; {s['margin_over_runner_up']:.4g} better than the runner-up "
                     f"(step {s['runner_up_step']})")
        return line

    def _write(self) -> None:
        tmp = self.out / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(self.summary(), indent=1), encoding="utf-8")
        os.replace(tmp, self.out / RECORD)

    def _load(self, resumed_at: int) -> None:
        """A resumed run keeps the scores of the steps up to its checkpoint."""
        try:
            data = json.loads((self.out / RECORD).read_text(encoding="utf-8"))
            if data.get("keep_best") == self.measure.text:
                self.scores = {int(k): float(v) for k, v in data.get("scores", {}).items()
                               if int(k) <= resumed_at}
        except (OSError, ValueError, TypeError, AttributeError):
            self.scores = {}
